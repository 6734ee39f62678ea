//! The store file format, byte by byte in `docs/formats.md`. Everything is
//! little-endian and fixed-width; every header carries a CRC-32C.
//!
//! ```text
//! 0        superblock A (4096)
//! 4096     superblock B (4096)
//! 8192     copy map A (map_bytes, 4096-aligned)
//! 8192+M   copy map B
//! data     records: expert e, copy c at data_offset + (2e + c) · record_bytes
//!          record = compute part | state part, each 4096-aligned:
//!          compute part = part header (64) | compute params (P · dtype bytes) | pad
//!          state part   = part header (64) | master f32 (4P) | m f32 (4P) | v f32 (4P) | pad
//! ```

use crate::error::{Part, TierError};
use crate::ExpertId;

pub const BLOCK_BYTES: usize = 4096;
pub const FORMAT_VERSION: u32 = 1;
pub const SUPERBLOCK_MAGIC: [u8; 8] = *b"STRATASB";
pub const PART_MAGIC: [u8; 4] = *b"SXPT";
pub const PART_HEADER_BYTES: usize = 64;
pub const MAP_ENTRY_BYTES: usize = 16;
/// A map entry's step for an expert that has never been written.
pub const NEVER_WRITTEN: u64 = u64::MAX;

const _: () = assert!(PART_HEADER_BYTES.is_multiple_of(16));
const _: () = assert!(BLOCK_BYTES.is_multiple_of(PART_HEADER_BYTES));

/// Rounds up to a whole number of 4096-byte blocks.
pub const fn align_up(bytes: u64) -> u64 {
    bytes.div_ceil(BLOCK_BYTES as u64) * BLOCK_BYTES as u64
}

/// Element type of the compute params.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    F32,
    Bf16,
    F16,
}

impl Dtype {
    pub fn bytes(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
        }
    }

    pub fn code(self) -> u8 {
        match self {
            Dtype::F32 => 0,
            Dtype::Bf16 => 1,
            Dtype::F16 => 2,
        }
    }

    pub fn from_code(code: u8) -> Option<Dtype> {
        match code {
            0 => Some(Dtype::F32),
            1 => Some(Dtype::Bf16),
            2 => Some(Dtype::F16),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "f32",
            Dtype::Bf16 => "bf16",
            Dtype::F16 => "f16",
        }
    }
}

/// The shape of a store: how many experts, how large, in what precision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub layers: u32,
    pub experts_per_layer: u32,
    pub params_per_expert: u64,
    pub compute_dtype: Dtype,
    /// The state part holds Adam moments (m, v) beside the f32 master
    /// params; without them (experts that do not train) it holds the
    /// master params alone.
    pub moments: bool,
}

impl Layout {
    pub fn validate(&self) -> Result<(), TierError> {
        let bad = |why: &str| Err(TierError::InvalidLayout(why.to_string()));
        if self.layers == 0 || self.experts_per_layer == 0 {
            return bad("a store needs at least one layer and one expert per layer");
        }
        if self.params_per_expert == 0 {
            return bad("experts need at least one param");
        }
        if self.params_per_expert > (1 << 40) {
            return bad("more than 2^40 params an expert");
        }
        Ok(())
    }

    pub fn expert_count(&self) -> u64 {
        self.layers as u64 * self.experts_per_layer as u64
    }

    /// Dense index of an expert, layer-major.
    pub fn slot_of(&self, id: ExpertId) -> Result<u64, TierError> {
        if id.layer >= self.layers || id.index >= self.experts_per_layer {
            return Err(TierError::NoSuchExpert {
                expert: id,
                layers: self.layers,
                experts_per_layer: self.experts_per_layer,
            });
        }
        Ok(id.dense_index(self.experts_per_layer as usize) as u64)
    }

    pub fn expert_at(&self, slot: u64) -> ExpertId {
        assert!(slot < self.expert_count());
        ExpertId::from_dense_index(slot as usize, self.experts_per_layer as usize)
    }

    pub fn compute_payload_bytes(&self) -> u64 {
        self.params_per_expert * self.compute_dtype.bytes()
    }

    pub fn state_payload_bytes(&self) -> u64 {
        self.params_per_expert * self.state_floats_per_param()
    }

    /// f32 values a param keeps in the state part: master, m and v, or the
    /// master alone without moments.
    pub fn state_floats_per_param(&self) -> u64 {
        match self.moments {
            true => 12,
            false => 4,
        }
    }

    pub fn compute_part_bytes(&self) -> u64 {
        align_up(PART_HEADER_BYTES as u64 + self.compute_payload_bytes())
    }

    pub fn state_part_bytes(&self) -> u64 {
        align_up(PART_HEADER_BYTES as u64 + self.state_payload_bytes())
    }

    /// One record: the compute part followed by the state part.
    pub fn record_bytes(&self) -> u64 {
        self.compute_part_bytes() + self.state_part_bytes()
    }

    pub fn map_bytes(&self) -> u64 {
        align_up(self.expert_count() * MAP_ENTRY_BYTES as u64)
    }

    pub fn map_offset(&self, which: usize) -> u64 {
        assert!(which < 2);
        2 * BLOCK_BYTES as u64 + which as u64 * self.map_bytes()
    }

    pub fn data_offset(&self) -> u64 {
        2 * BLOCK_BYTES as u64 + 2 * self.map_bytes()
    }

    /// Where copy `copy` of expert slot `slot` starts.
    pub fn record_offset(&self, slot: u64, copy: u8) -> u64 {
        assert!(copy < 2 && slot < self.expert_count());
        self.data_offset() + (2 * slot + copy as u64) * self.record_bytes()
    }

    pub fn file_bytes(&self) -> u64 {
        self.data_offset() + 2 * self.expert_count() * self.record_bytes()
    }
}

pub fn crc(bytes: &[u8]) -> u32 {
    crc32c::crc32c(bytes)
}

/// `crc` of `a` followed by `bytes`, from `crc(a)`.
pub fn crc32c_append(crc: u32, bytes: &[u8]) -> u32 {
    crc32c::crc32c_append(crc, bytes)
}

fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}
fn get_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}
fn get_u32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn get_u64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// The header at the start of each part of a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartHeader {
    pub part: Part,
    pub dtype: Dtype,
    pub expert: ExpertId,
    pub step: u64,
    pub payload_bytes: u64,
    pub payload_crc: u32,
}

impl PartHeader {
    /// Writes the 64-byte header into `out[..64]`.
    pub fn encode(&self, out: &mut [u8]) {
        assert!(out.len() >= PART_HEADER_BYTES);
        let h = &mut out[..PART_HEADER_BYTES];
        h.fill(0);
        h[0..4].copy_from_slice(&PART_MAGIC);
        put_u16(h, 4, FORMAT_VERSION as u16);
        h[6] = match self.part {
            Part::Compute => 0,
            Part::State => 1,
        };
        h[7] = self.dtype.code();
        put_u32(h, 8, self.expert.layer);
        put_u32(h, 12, self.expert.index);
        put_u64(h, 16, self.step);
        put_u64(h, 24, self.payload_bytes);
        put_u32(h, 32, self.payload_crc);
        let header_crc = crc(&h[..60]);
        put_u32(h, 60, header_crc);
    }

    /// Parses and checks a header read for `expected` / `part`.
    pub fn decode(bytes: &[u8], expected: ExpertId, part: Part) -> Result<PartHeader, TierError> {
        assert!(bytes.len() >= PART_HEADER_BYTES);
        let h = &bytes[..PART_HEADER_BYTES];
        let corrupt = |what: &'static str| TierError::CorruptRecord {
            expert: expected,
            part,
            what,
        };
        if h[0..4] != PART_MAGIC {
            return Err(corrupt("bad record magic"));
        }
        if get_u32(h, 60) != crc(&h[..60]) {
            return Err(TierError::Checksum {
                expert: expected,
                part,
                what: "record header",
            });
        }
        let version = get_u16(h, 4) as u32;
        if version != FORMAT_VERSION {
            return Err(TierError::UnsupportedVersion {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let found_part = match h[6] {
            0 => Part::Compute,
            1 => Part::State,
            _ => return Err(corrupt("unknown part kind")),
        };
        if found_part != part {
            return Err(corrupt("part kind differs from its position"));
        }
        let dtype = Dtype::from_code(h[7]).ok_or_else(|| corrupt("unknown dtype"))?;
        let expert = ExpertId {
            layer: get_u32(h, 8),
            index: get_u32(h, 12),
        };
        if expert != expected {
            return Err(corrupt("record names another expert"));
        }
        Ok(PartHeader {
            part,
            dtype,
            expert,
            step: get_u64(h, 16),
            payload_bytes: get_u64(h, 24),
            payload_crc: get_u32(h, 32),
        })
    }
}

/// One superblock: which checkpoint is committed, and the layout.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Superblock {
    pub generation: u64,
    pub committed_step: u64,
    pub layout: Layout,
    /// CRC-32C of this generation's copy map (map region `generation % 2`).
    pub map_crc: u32,
}

/// Superblock byte 49, bit 0: the records hold no Adam moments.
const FLAG_NO_MOMENTS: u8 = 1;

impl Superblock {
    pub const ENCODED_BYTES: usize = 96;

    pub fn encode(&self) -> [u8; BLOCK_BYTES] {
        let mut b = [0u8; BLOCK_BYTES];
        b[0..8].copy_from_slice(&SUPERBLOCK_MAGIC);
        put_u32(&mut b, 8, FORMAT_VERSION);
        put_u32(&mut b, 12, Self::ENCODED_BYTES as u32);
        put_u64(&mut b, 16, self.generation);
        put_u64(&mut b, 24, self.committed_step);
        put_u32(&mut b, 32, self.layout.layers);
        put_u32(&mut b, 36, self.layout.experts_per_layer);
        put_u64(&mut b, 40, self.layout.params_per_expert);
        b[48] = self.layout.compute_dtype.code();
        b[49] = match self.layout.moments {
            true => 0,
            false => FLAG_NO_MOMENTS,
        };
        put_u64(&mut b, 56, self.layout.record_bytes());
        put_u64(&mut b, 64, self.layout.map_bytes());
        put_u64(&mut b, 72, self.layout.data_offset());
        put_u32(&mut b, 80, self.map_crc);
        let sb_crc = crc(&b[..Self::ENCODED_BYTES - 4]);
        put_u32(&mut b, Self::ENCODED_BYTES - 4, sb_crc);
        b
    }

    /// Parses one superblock copy; `Ok(None)` when it is absent or torn
    /// (bad magic or checksum), an error when it is from another version.
    pub fn decode(b: &[u8]) -> Result<Option<Superblock>, TierError> {
        assert!(b.len() >= Self::ENCODED_BYTES);
        if b[0..8] != SUPERBLOCK_MAGIC {
            return Ok(None);
        }
        if get_u32(b, Self::ENCODED_BYTES - 4) != crc(&b[..Self::ENCODED_BYTES - 4]) {
            return Ok(None);
        }
        let version = get_u32(b, 8);
        if version != FORMAT_VERSION {
            return Err(TierError::UnsupportedVersion {
                found: version,
                supported: FORMAT_VERSION,
            });
        }
        let dtype =
            Dtype::from_code(b[48]).ok_or(TierError::CorruptSuperblock("unknown compute dtype"))?;
        if b[49] & !FLAG_NO_MOMENTS != 0 {
            return Err(TierError::CorruptSuperblock("unknown layout flags"));
        }
        let layout = Layout {
            layers: get_u32(b, 32),
            experts_per_layer: get_u32(b, 36),
            params_per_expert: get_u64(b, 40),
            compute_dtype: dtype,
            moments: b[49] & FLAG_NO_MOMENTS == 0,
        };
        layout
            .validate()
            .map_err(|_| TierError::CorruptSuperblock("impossible layout"))?;
        if get_u64(b, 56) != layout.record_bytes()
            || get_u64(b, 64) != layout.map_bytes()
            || get_u64(b, 72) != layout.data_offset()
        {
            return Err(TierError::CorruptSuperblock(
                "sizes disagree with the layout",
            ));
        }
        Ok(Some(Superblock {
            generation: get_u64(b, 16),
            committed_step: get_u64(b, 24),
            layout,
            map_crc: get_u32(b, 80),
        }))
    }
}

/// Which copy of each expert's record belongs to the committed checkpoint,
/// and the step that copy was written at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapEntry {
    pub step: u64,
    pub copy: u8,
}

pub fn encode_map(entries: &[MapEntry], out: &mut [u8]) {
    assert!(out.len() >= entries.len() * MAP_ENTRY_BYTES);
    out.fill(0);
    for (i, e) in entries.iter().enumerate() {
        let at = i * MAP_ENTRY_BYTES;
        put_u64(out, at, e.step);
        out[at + 8] = e.copy;
    }
}

pub fn decode_map(bytes: &[u8], count: usize) -> Result<Vec<MapEntry>, TierError> {
    assert!(bytes.len() >= count * MAP_ENTRY_BYTES);
    (0..count)
        .map(|i| {
            let at = i * MAP_ENTRY_BYTES;
            let copy = bytes[at + 8];
            if copy > 1 {
                return Err(TierError::CorruptSuperblock("copy map names a third copy"));
            }
            Ok(MapEntry {
                step: get_u64(bytes, at),
                copy,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> Layout {
        Layout {
            layers: 3,
            experts_per_layer: 5,
            params_per_expert: 1000,
            compute_dtype: Dtype::Bf16,
            moments: true,
        }
    }

    #[test]
    fn parts_are_block_aligned_and_hold_their_payload() {
        let l = layout();
        assert_eq!(l.compute_part_bytes(), 4096);
        assert_eq!(l.state_part_bytes(), 12288); // 64 + 12000 rounded up
        assert_eq!(l.record_bytes() % 4096, 0);
        assert_eq!(l.data_offset() % 4096, 0);
        assert_eq!(l.record_offset(14, 1), l.file_bytes() - l.record_bytes());
    }

    #[test]
    fn part_header_round_trips_and_catches_damage() {
        let e = ExpertId { layer: 2, index: 4 };
        let h = PartHeader {
            part: Part::State,
            dtype: Dtype::Bf16,
            expert: e,
            step: 77,
            payload_bytes: 12000,
            payload_crc: 0xdead_beef,
        };
        let mut b = [0u8; 64];
        h.encode(&mut b);
        assert_eq!(PartHeader::decode(&b, e, Part::State).unwrap(), h);
        let other = ExpertId { layer: 2, index: 3 };
        assert!(PartHeader::decode(&b, other, Part::State).is_err());
        assert!(PartHeader::decode(&b, e, Part::Compute).is_err());
        b[17] ^= 1;
        assert!(matches!(
            PartHeader::decode(&b, e, Part::State),
            Err(TierError::Checksum { .. })
        ));
    }

    #[test]
    fn superblock_round_trips_and_a_torn_one_reads_as_absent() {
        let sb = Superblock {
            generation: 9,
            committed_step: 41,
            layout: layout(),
            map_crc: 5,
        };
        let mut b = sb.encode();
        assert_eq!(Superblock::decode(&b).unwrap(), Some(sb));
        b[20] ^= 0x40;
        assert_eq!(Superblock::decode(&b).unwrap(), None);
        assert_eq!(Superblock::decode(&[0u8; 4096]).unwrap(), None);
    }
}
