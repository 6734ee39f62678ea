//! [`PartsCheck`]: checks the headers and payload checksums of one read
//! (a record's compute part, state part, or both) from its bytes fed in
//! order, so a read split into chunks is checked chunk by chunk as they
//! arrive rather than whole after the last one: the disk's next reads then
//! overlap all but the last chunk's checksum.

use crate::error::Part;
use crate::format::{crc32c_append, Dtype, Layout, PartHeader, PART_HEADER_BYTES};
use crate::record::Parts;
use crate::{ExpertId, TierError};

/// One part of the read: where its header and payload lie in the read's
/// buffer, what the layout says they must be, and the checksum so far.
struct PartSpan {
    part: Part,
    /// Offset of the 64-byte header in the read's buffer.
    at: usize,
    payload_bytes: u64,
    dtype: Dtype,
    header: [u8; PART_HEADER_BYTES],
    payload_crc: u32,
}

impl PartSpan {
    fn payload(&self) -> std::ops::Range<usize> {
        let start = self.at + PART_HEADER_BYTES;
        start..start + self.payload_bytes as usize
    }
}

/// Checks one read of `parts` of `expert`'s record of `step`. Feed it the
/// read's bytes in order (`feed`), then `finish`.
pub(crate) struct PartsCheck {
    expert: ExpertId,
    step: u64,
    spans: Vec<PartSpan>,
    /// Bytes of the read fed so far.
    fed: usize,
}

impl PartsCheck {
    pub fn new(layout: &Layout, expert: ExpertId, parts: Parts, step: u64) -> Self {
        let span = |part, at, payload_bytes, dtype| PartSpan {
            part,
            at,
            payload_bytes,
            dtype,
            header: [0; PART_HEADER_BYTES],
            payload_crc: 0,
        };
        let mut spans = Vec::with_capacity(2);
        if parts.includes_compute() {
            spans.push(span(
                Part::Compute,
                0,
                layout.compute_payload_bytes(),
                layout.compute_dtype,
            ));
        }
        if parts.includes_state() {
            let at = match parts {
                Parts::State => 0,
                _ => layout.compute_part_bytes() as usize,
            };
            spans.push(span(
                Part::State,
                at,
                layout.state_payload_bytes(),
                Dtype::F32,
            ));
        }
        Self {
            expert,
            step,
            spans,
            fed: 0,
        }
    }

    /// Feeds the read's next bytes: `bytes` starts where the last call's
    /// ended (the read's first byte on the first call).
    pub fn feed(&mut self, bytes: &[u8]) {
        let start = self.fed;
        let end = start + bytes.len();
        let overlap = |r: std::ops::Range<usize>| r.start.max(start)..r.end.min(end);
        for span in &mut self.spans {
            let h = overlap(span.at..span.at + PART_HEADER_BYTES);
            if h.start < h.end {
                span.header[h.start - span.at..h.end - span.at]
                    .copy_from_slice(&bytes[h.start - start..h.end - start]);
            }
            let p = overlap(span.payload());
            if p.start < p.end {
                span.payload_crc =
                    crc32c_append(span.payload_crc, &bytes[p.start - start..p.end - start]);
            }
        }
        self.fed = end;
    }

    /// The verdict, once every byte of the read has been fed: each part's
    /// header is intact and names this expert, the committed step, the
    /// layout's payload size and dtype, and its payload's checksum.
    pub fn finish(self) -> Result<(), TierError> {
        let expert = self.expert;
        for span in &self.spans {
            debug_assert!(
                self.fed >= span.payload().end,
                "finish before the last byte"
            );
            let h = PartHeader::decode(&span.header, expert, span.part)?;
            let corrupt = |what| TierError::CorruptRecord {
                expert,
                part: span.part,
                what,
            };
            if h.step != self.step {
                return Err(corrupt("record step differs from the committed map"));
            }
            if h.payload_bytes != span.payload_bytes || h.dtype != span.dtype {
                return Err(corrupt("record size or dtype differs from the layout"));
            }
            if span.payload_crc != h.payload_crc {
                return Err(TierError::Checksum {
                    expert,
                    part: span.part,
                    what: "payload",
                });
            }
        }
        Ok(())
    }
}

/// Checks a batch of reads split into chunks (ops), whose chunks arrive in
/// any order: each read's chunks are fed to its `PartsCheck` in order, a
/// chunk that arrives early being held until those before it have come.
pub(crate) struct ChunkVerifier<'a> {
    checks: Vec<Option<PartsCheck>>,
    /// Per op: the read it belongs to (a read's ops are consecutive).
    owner: &'a [usize],
    /// Per op: its bytes, while an earlier chunk of its read is still out.
    held: Vec<Option<&'a [u8]>>,
    /// Per read: its next op to feed, and its ops' end.
    next: Vec<usize>,
    end: Vec<usize>,
    first_error: Option<TierError>,
}

impl<'a> ChunkVerifier<'a> {
    pub fn new(checks: Vec<PartsCheck>, owner: &'a [usize]) -> Self {
        let reads = checks.len();
        let (mut next, mut end) = (vec![usize::MAX; reads], vec![0; reads]);
        for (i, &r) in owner.iter().enumerate() {
            next[r] = next[r].min(i);
            end[r] = i + 1;
        }
        Self {
            checks: checks.into_iter().map(Some).collect(),
            owner,
            held: vec![None; owner.len()],
            next,
            end,
            first_error: None,
        }
    }

    /// Op `i` has arrived with `bytes`.
    pub fn arrived(&mut self, i: usize, bytes: &'a [u8]) {
        if self.first_error.is_some() {
            return; // the batch is failing anyway
        }
        let r = self.owner[i];
        self.held[i] = Some(bytes);
        let Some(check) = self.checks[r].as_mut() else {
            return;
        };
        while self.next[r] < self.end[r] {
            let Some(bytes) = self.held[self.next[r]].take() else {
                return;
            };
            check.feed(bytes);
            self.next[r] += 1;
        }
        let check = self.checks[r].take().expect("checked once");
        self.first_error = check.finish().err();
    }

    /// The first failed check, if any. (After an I/O error, reads whose
    /// chunks did not all arrive are left unchecked: the batch fails with
    /// that error.)
    pub fn into_error(self) -> Option<TierError> {
        self.first_error
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout {
            layers: 2,
            experts_per_layer: 3,
            params_per_expert: 3000,
            compute_dtype: Dtype::Bf16,
            moments: true,
        }
    }

    /// A stamped full record of `expert` at `step`.
    fn record(layout: &Layout, expert: ExpertId, step: u64) -> Vec<u8> {
        let mut buf = vec![0u8; layout.record_bytes() as usize];
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i * 7 % 251) as u8;
        }
        crate::store::stamp(layout, expert, step, &mut buf);
        buf
    }

    fn check_in_pieces(
        layout: &Layout,
        buf: &[u8],
        parts: Parts,
        piece: usize,
    ) -> Result<(), TierError> {
        let expert = ExpertId::new(1, 2);
        let mut check = PartsCheck::new(layout, expert, parts, 5);
        for chunk in buf.chunks(piece) {
            check.feed(chunk);
        }
        assert_eq!(check.fed, buf.len());
        check.finish()
    }

    #[test]
    fn any_split_of_a_sound_read_passes_and_a_flipped_byte_fails() {
        let layout = layout();
        let full = record(&layout, ExpertId::new(1, 2), 5);
        for parts in [Parts::Compute, Parts::State, Parts::Full] {
            let bytes = &full[parts.range(&layout)];
            for piece in [1, 63, 64, 65, 4096, 5000, bytes.len()] {
                check_in_pieces(&layout, bytes, parts, piece).unwrap();
            }
            // A payload byte of each part, and a header byte.
            let cpb = layout.compute_part_bytes() as usize;
            let mut flips = vec![PART_HEADER_BYTES + 10, 3];
            if parts == Parts::Full {
                flips.push(cpb + PART_HEADER_BYTES + 100);
            }
            for at in flips {
                let mut bad = bytes.to_vec();
                bad[at] ^= 1;
                for piece in [7, 4096, bad.len()] {
                    let e = check_in_pieces(&layout, &bad, parts, piece).unwrap_err();
                    assert!(
                        matches!(
                            e,
                            TierError::Checksum { .. } | TierError::CorruptRecord { .. }
                        ),
                        "{e}"
                    );
                }
            }
        }
    }

    #[test]
    fn chunks_arriving_out_of_order_are_fed_in_order() {
        let layout = layout();
        let a = record(&layout, ExpertId::new(1, 2), 5);
        let b = record(&layout, ExpertId::new(0, 1), 5);
        let check = |bad: bool, order: &[usize]| {
            let mut b = b.clone();
            if bad {
                b[PART_HEADER_BYTES + 9] ^= 4;
            }
            let chunks: Vec<&[u8]> = a.chunks(4096).chain(b.chunks(4096)).collect();
            let owner: Vec<usize> = (0..chunks.len())
                .map(|i| usize::from(i >= a.len().div_ceil(4096)))
                .collect();
            let checks = vec![
                PartsCheck::new(&layout, ExpertId::new(1, 2), Parts::Full, 5),
                PartsCheck::new(&layout, ExpertId::new(0, 1), Parts::Full, 5),
            ];
            let mut v = ChunkVerifier::new(checks, &owner);
            for &i in order {
                v.arrived(i, chunks[i]);
            }
            v.into_error()
        };
        let n = a.len().div_ceil(4096) * 2;
        let forward: Vec<usize> = (0..n).collect();
        let backward: Vec<usize> = (0..n).rev().collect();
        let mut shuffled = forward.clone();
        shuffled.sort_by_key(|&i| (i * 7919) % n);
        for order in [&forward, &backward, &shuffled] {
            assert!(check(false, order).is_none());
            assert!(matches!(
                check(true, order),
                Some(TierError::Checksum { .. })
            ));
        }
    }

    #[test]
    fn another_step_or_expert_is_refused() {
        let layout = layout();
        let other_step = record(&layout, ExpertId::new(1, 2), 4);
        let e = check_in_pieces(&layout, &other_step, Parts::Full, 4096).unwrap_err();
        assert!(matches!(e, TierError::CorruptRecord { .. }), "{e}");
        let other_expert = record(&layout, ExpertId::new(0, 2), 5);
        assert!(check_in_pieces(&layout, &other_expert, Parts::Full, 4096).is_err());
    }
}
