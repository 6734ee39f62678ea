//! Typed views of one record held in a 4096-aligned host buffer, laid out
//! exactly as on disk (see `format.rs`).

use half::{bf16, f16};

use crate::format::{Dtype, Layout, PART_HEADER_BYTES};
use crate::TierError;

/// Which parts of a record a reader needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Parts {
    /// The compute params only (forward and backward).
    Compute,
    /// Compute params and optimizer state.
    Full,
    /// The optimizer state alone. A buffer read for it holds just the
    /// state part; a host slot loaded with it holds the state part at its
    /// place in the record and a compute part that is not the record's
    /// (an update writes it whole, from the new master params).
    State,
}

impl Parts {
    /// Bytes a buffer needs to hold these parts.
    pub fn bytes(self, layout: &Layout) -> u64 {
        match self {
            Parts::Compute => layout.compute_part_bytes(),
            Parts::Full => layout.record_bytes(),
            Parts::State => layout.state_part_bytes(),
        }
    }

    /// The byte range of a record these parts occupy.
    pub fn range(self, layout: &Layout) -> std::ops::Range<usize> {
        let cpb = layout.compute_part_bytes() as usize;
        match self {
            Parts::Compute => 0..cpb,
            Parts::Full => 0..layout.record_bytes() as usize,
            Parts::State => cpb..layout.record_bytes() as usize,
        }
    }

    pub fn includes_compute(self) -> bool {
        self != Parts::State
    }

    pub fn includes_state(self) -> bool {
        self != Parts::Compute
    }

    /// The part a buffer holding `held` must still read to serve an
    /// access to `self`: none where `held` covers it.
    pub fn missing_from(self, held: Parts) -> Option<Parts> {
        if held == Parts::Full || held == self {
            return None;
        }
        match (self, held) {
            (Parts::Compute, Parts::State) | (Parts::Full, Parts::State) => Some(Parts::Compute),
            (Parts::State, Parts::Compute) | (Parts::Full, Parts::Compute) => Some(Parts::State),
            _ => None, // `self` Compute or State, held Full: covered above
        }
    }
}

/// The state part, split into its three f32 arrays (m and v empty in a
/// layout without moments), and the compute bytes.
pub struct RecordMut<'a> {
    /// Compute params in the store's dtype, as raw little-endian bytes.
    pub compute: &'a mut [u8],
    pub master: &'a mut [f32],
    pub m: &'a mut [f32],
    pub v: &'a mut [f32],
}

fn check_len(what: &'static str, buf: &[u8], expected: u64) -> Result<(), TierError> {
    if (buf.len() as u64) < expected {
        return Err(TierError::BufferSize {
            what,
            expected: expected as usize,
            got: buf.len(),
        });
    }
    Ok(())
}

/// The compute params of a record buffer (compute part at its start).
pub fn compute_bytes<'a>(layout: &Layout, buf: &'a [u8]) -> Result<&'a [u8], TierError> {
    check_len("compute params", buf, layout.compute_part_bytes())?;
    let start = PART_HEADER_BYTES;
    Ok(&buf[start..start + layout.compute_payload_bytes() as usize])
}

/// Every typed view of a full record buffer.
pub fn record_mut<'a>(layout: &Layout, buf: &'a mut [u8]) -> Result<RecordMut<'a>, TierError> {
    check_len("a full record", buf, layout.record_bytes())?;
    let cpb = layout.compute_part_bytes() as usize;
    let (compute_part, state_part) = buf.split_at_mut(cpb);
    let compute = &mut compute_part
        [PART_HEADER_BYTES..PART_HEADER_BYTES + layout.compute_payload_bytes() as usize];
    let n = layout.params_per_expert as usize;
    let misalignment = state_part.as_ptr() as usize % 4;
    let state_len = layout.state_payload_bytes() as usize;
    let state = &mut state_part[PART_HEADER_BYTES..PART_HEADER_BYTES + state_len];
    // The buffer is 4096-aligned and every offset here is a multiple of 4,
    // so the casts cannot fail on alignment (bytemuck checks anyway).
    let floats: &mut [f32] =
        bytemuck::try_cast_slice_mut(state).map_err(|_| TierError::BufferSize {
            what: "a 4-byte-aligned record buffer",
            expected: 4,
            got: misalignment,
        })?;
    // Without moments, m and v are empty.
    let (master, rest) = floats.split_at_mut(n);
    let (m, v) = rest.split_at_mut(rest.len() / 2);
    Ok(RecordMut {
        compute,
        master,
        m,
        v,
    })
}

/// Writes `values` in the store's compute dtype (little-endian) into `out`.
pub fn encode_compute(dtype: Dtype, values: &[f32], out: &mut [u8]) {
    match dtype {
        Dtype::F32 => {
            for (c, v) in out.chunks_exact_mut(4).zip(values) {
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        Dtype::Bf16 => {
            for (c, v) in out.chunks_exact_mut(2).zip(values) {
                c.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
            }
        }
        Dtype::F16 => {
            for (c, v) in out.chunks_exact_mut(2).zip(values) {
                c.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::Dtype;
    use crate::io::AlignedBuf;

    #[test]
    fn a_held_part_serves_the_accesses_it_covers() {
        use Parts::{Compute, Full, State};
        for held in [Compute, Full, State] {
            assert_eq!(held.missing_from(held), None);
            assert_eq!(held.missing_from(Full), None);
        }
        assert_eq!(Compute.missing_from(State), Some(Compute));
        assert_eq!(Full.missing_from(State), Some(Compute));
        assert_eq!(State.missing_from(Compute), Some(State));
        assert_eq!(Full.missing_from(Compute), Some(State));
    }

    #[test]
    fn views_cover_disjoint_parts_of_the_record() {
        let layout = Layout {
            layers: 1,
            experts_per_layer: 1,
            params_per_expert: 10,
            compute_dtype: Dtype::Bf16,
            moments: true,
        };
        let mut buf = AlignedBuf::zeroed(layout.record_bytes() as usize);
        {
            let r = record_mut(&layout, buf.as_mut_slice()).unwrap();
            assert_eq!(r.compute.len(), 20);
            assert_eq!((r.master.len(), r.m.len(), r.v.len()), (10, 10, 10));
            r.compute[0] = 1;
            r.master[0] = 2.0;
            r.v[9] = 3.0;
        }
        let b = buf.as_slice();
        assert_eq!(b[64], 1);
        assert_eq!(&b[4096 + 64..4096 + 68], &2.0f32.to_le_bytes());
        assert_eq!(&b[4096 + 64 + 116..4096 + 120 + 64], &3.0f32.to_le_bytes());
        assert!(record_mut(&layout, &mut [0u8; 100]).is_err());
    }
}
