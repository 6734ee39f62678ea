//! TensorBoard event files (`--tensorboard DIR`): the run's scalars as the
//! run goes, in the format TensorBoard reads, so the run shows up next to
//! a user's other runs.
//!
//! The format is TensorFlow's TFRecord of `Event` protocol buffers: each
//! record is its length (u64, little-endian), the masked CRC-32C of the
//! length, the bytes, and their masked CRC-32C. The first event names the
//! file version; each later one holds a step's scalars as a `Summary` of
//! `(tag, simple_value)` pairs. The few protobuf fields written are
//! encoded here by hand (a wire format of tags and varints).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use strata::engine::StepMetrics;

/// One events file in a TensorBoard log directory.
pub struct EventWriter {
    file: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// A new events file in `dir` (created if need be), named as
    /// TensorBoard expects: `events.out.tfevents.<seconds>.<host>.strata`.
    pub fn create(dir: &Path) -> Result<Self, String> {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("--tensorboard {}: cannot create it: {e}", dir.display()))?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "host".into());
        let secs = now().floor() as u64;
        let path = dir.join(format!("events.out.tfevents.{secs}.{host}.strata"));
        let file =
            File::create(&path).map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        let mut writer = Self {
            file: BufWriter::new(file),
            path,
        };
        let mut first = Vec::new();
        put_double(&mut first, 1, now());
        put_bytes(&mut first, 3, b"brain.Event:2");
        writer.record(&first)?;
        Ok(writer)
    }

    /// A step's scalars: loss, learning rate, tokens/s, the share of the
    /// step stalled on each tier, and the gradient norm where it is known.
    pub fn step(&mut self, step: u64, m: &StepMetrics, lr: f32) -> Result<(), String> {
        let wall = m.wall_s.max(1e-9);
        let mut values = vec![
            ("train/loss", m.loss),
            ("train/lr", lr),
            ("train/tokens_per_s", (m.tokens as f64 / wall) as f32),
            ("stall/ssd", (m.stall_ssd_s / wall) as f32),
            ("stall/upload", (m.stall_upload_s / wall) as f32),
            ("stall/optimizer", (m.stall_optimizer_s / wall) as f32),
        ];
        if let Some(norm) = m.grad_norm {
            values.push(("train/grad_norm", norm as f32));
        }
        self.scalars(step, &values)
    }

    /// `values` as one event at `step`, written through to the file (a run
    /// in progress shows in TensorBoard as it goes).
    pub fn scalars(&mut self, step: u64, values: &[(&str, f32)]) -> Result<(), String> {
        let mut summary = Vec::new();
        for (tag, value) in values {
            let mut v = Vec::new();
            put_bytes(&mut v, 1, tag.as_bytes());
            put_key(&mut v, 2, 5);
            v.extend_from_slice(&value.to_le_bytes());
            put_bytes(&mut summary, 1, &v);
        }
        let mut event = Vec::new();
        put_double(&mut event, 1, now());
        put_key(&mut event, 2, 0);
        put_varint(&mut event, step);
        put_bytes(&mut event, 5, &summary);
        self.record(&event)?;
        self.file
            .flush()
            .map_err(|e| format!("cannot write {}: {e}", self.path.display()))
    }

    fn record(&mut self, data: &[u8]) -> Result<(), String> {
        let len = (data.len() as u64).to_le_bytes();
        let mut bytes = Vec::with_capacity(data.len() + 16);
        bytes.extend_from_slice(&len);
        bytes.extend_from_slice(&masked_crc(&len).to_le_bytes());
        bytes.extend_from_slice(data);
        bytes.extend_from_slice(&masked_crc(data).to_le_bytes());
        self.file
            .write_all(&bytes)
            .map_err(|e| format!("cannot write {}: {e}", self.path.display()))
    }
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// TFRecord's checksum: CRC-32C, rotated right by 15 and offset.
fn masked_crc(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn put_varint(out: &mut Vec<u8>, mut x: u64) {
    while x >= 0x80 {
        out.push((x as u8) | 0x80);
        x >>= 7;
    }
    out.push(x as u8);
}

/// A field's key: its number and wire type (0 varint, 1 64-bit, 2
/// length-delimited, 5 32-bit).
fn put_key(out: &mut Vec<u8>, field: u64, wire: u64) {
    put_varint(out, field << 3 | wire);
}

fn put_double(out: &mut Vec<u8>, field: u64, x: f64) {
    put_key(out, field, 1);
    out.extend_from_slice(&x.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    put_key(out, field, 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reader of what the writer writes: each record's framing and both
    /// checksums, then the events' steps and scalars.
    fn read_events(path: &Path) -> Vec<(u64, Vec<(String, f32)>)> {
        let bytes = std::fs::read(path).unwrap();
        let mut at = 0;
        let mut events = Vec::new();
        while at < bytes.len() {
            let len_bytes = &bytes[at..at + 8];
            let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
            let crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
            assert_eq!(crc, masked_crc(len_bytes), "length checksum");
            let data = &bytes[at + 12..at + 12 + len];
            let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
            assert_eq!(crc, masked_crc(data), "data checksum");
            events.push(parse_event(data));
            at += 16 + len;
        }
        events
    }

    fn varint(b: &[u8], at: &mut usize) -> u64 {
        let (mut x, mut shift) = (0u64, 0);
        loop {
            let byte = b[*at];
            *at += 1;
            x |= ((byte & 0x7f) as u64) << shift;
            if byte < 0x80 {
                return x;
            }
            shift += 7;
        }
    }

    /// (field, wire, payload) of each field of a message.
    fn fields(b: &[u8]) -> Vec<(u64, u64, Vec<u8>)> {
        let mut at = 0;
        let mut out = Vec::new();
        while at < b.len() {
            let key = varint(b, &mut at);
            let (field, wire) = (key >> 3, key & 7);
            let payload = match wire {
                0 => varint(b, &mut at).to_le_bytes().to_vec(),
                1 => {
                    at += 8;
                    b[at - 8..at].to_vec()
                }
                2 => {
                    let n = varint(b, &mut at) as usize;
                    at += n;
                    b[at - n..at].to_vec()
                }
                5 => {
                    at += 4;
                    b[at - 4..at].to_vec()
                }
                other => panic!("wire type {other}"),
            };
            out.push((field, wire, payload));
        }
        out
    }

    fn parse_event(data: &[u8]) -> (u64, Vec<(String, f32)>) {
        let mut step = 0;
        let mut values = Vec::new();
        for (field, _, payload) in fields(data) {
            match field {
                2 => step = u64::from_le_bytes(payload.try_into().unwrap()),
                3 => assert_eq!(payload, b"brain.Event:2"),
                5 => {
                    for (_, _, value) in fields(&payload) {
                        let v = fields(&value);
                        let tag = String::from_utf8(v[0].2.clone()).unwrap();
                        let x = f32::from_le_bytes(v[1].2.clone().try_into().unwrap());
                        values.push((tag, x));
                    }
                }
                _ => {}
            }
        }
        (step, values)
    }

    #[test]
    fn events_read_back_with_their_checksums() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(&dir.path().join("tb")).unwrap();
        let m = StepMetrics {
            loss: 2.5,
            tokens: 1000,
            wall_s: 0.5,
            stall_ssd_s: 0.25,
            grad_norm: Some(3.0),
            ..StepMetrics::default()
        };
        w.step(300, &m, 1e-3).unwrap();
        w.scalars(300, &[("eval/loss", 2.25)]).unwrap();
        let path = w.path.clone();
        drop(w);
        assert!(path
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("events.out.tfevents."));
        let events = read_events(&path);
        assert_eq!(events.len(), 3, "the version event and two steps");
        assert_eq!(events[0].1, vec![]);
        let (step, values) = &events[1];
        assert_eq!(*step, 300);
        let get = |tag: &str| values.iter().find(|(t, _)| t == tag).unwrap().1;
        assert_eq!(get("train/loss"), 2.5);
        assert_eq!(get("train/lr"), 1e-3);
        assert_eq!(get("train/tokens_per_s"), 2000.0);
        assert_eq!(get("stall/ssd"), 0.5);
        assert_eq!(get("train/grad_norm"), 3.0);
        assert_eq!(events[2], (300, vec![("eval/loss".to_string(), 2.25)]));
    }
}
