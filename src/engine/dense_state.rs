//! The dense part of a checkpoint: dense params, their Adam moments and
//! step, in `<store>.dense-<step>` beside the store file. It is written
//! (under a temporary name, fsynced, renamed) before the store commits the
//! same step, so the store's committed step always has its dense file.
//!
//! Layout (little-endian): magic `STRATADN`, u32 version, u64 step,
//! u64 dense AdamW step, u64 count N, (version 2: u64 count M,) N f32
//! params, M f32 m, M f32 v, u32 CRC-32C of everything before it
//! (`docs/formats.md`). The moments are the trainable params' alone, in
//! order: version 1, written where every param trains, has M = N.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::EngineError;

const MAGIC: &[u8; 8] = b"STRATADN";
/// Where every param trains; version 2 adds the moments' count.
const VERSION_ALL_TRAIN: u32 = 1;
const VERSION: u32 = 2;
/// The write buffer (and the largest piece of the state converted to
/// bytes at once).
const BUFFER_BYTES: usize = 1 << 20;

pub(crate) struct DenseState {
    pub step: u64,
    pub dense_step: u64,
    pub params: Vec<f32>,
    /// The trainable params' moments, in order.
    pub m: Vec<f32>,
    pub v: Vec<f32>,
}

pub(crate) fn path_for(store: &Path, step: u64) -> PathBuf {
    let mut name = store.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".dense-{step}"));
    store.with_file_name(name)
}

fn io_error(path: &Path, e: std::io::Error) -> EngineError {
    EngineError::File {
        path: path.to_path_buf(),
        why: e.to_string(),
    }
}

impl DenseState {
    /// The state as borrowed slices, to write.
    pub fn as_ref(&self) -> DenseStateRef<'_> {
        DenseStateRef {
            step: self.step,
            dense_step: self.dense_step,
            params: &self.params,
            m: &self.m,
            v: &self.v,
        }
    }
}

/// What `write` writes: a [`DenseState`] borrowed from its owner, so a
/// checkpoint copies nothing of it.
pub(crate) struct DenseStateRef<'a> {
    pub step: u64,
    pub dense_step: u64,
    pub params: &'a [f32],
    /// The trainable params' moments, in order.
    pub m: &'a [f32],
    pub v: &'a [f32],
}

/// A writer that keeps the CRC-32C of what went through it.
struct Checksummed<W> {
    inner: W,
    crc: u32,
}

impl<W: Write> Write for Checksummed<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let written = self.inner.write(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, &buf[..written]);
        Ok(written)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Streams `state` to the file through a buffer of `BUFFER_BYTES`: a
/// checkpoint stages none of the dense state.
pub(crate) fn write(store: &Path, state: &DenseStateRef<'_>) -> Result<(), EngineError> {
    let path = path_for(store, state.step);
    let tmp = path.with_extension("partial");
    let file = std::fs::File::create(&tmp).map_err(|e| io_error(&tmp, e))?;
    let mut out = Checksummed {
        inner: std::io::BufWriter::with_capacity(BUFFER_BYTES, file),
        crc: 0,
    };
    write_body(&mut out, state).map_err(|e| io_error(&tmp, e))?;
    let crc = out.crc;
    let mut file = out.inner;
    file.write_all(&crc.to_le_bytes())
        .map_err(|e| io_error(&tmp, e))?;
    let file = file
        .into_inner()
        .map_err(|e| io_error(&tmp, e.into_error()))?;
    file.sync_all().map_err(|e| io_error(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| io_error(&path, e))?;
    if let Some(dir) = path.parent() {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

/// Everything before the checksum.
fn write_body(out: &mut impl Write, state: &DenseStateRef<'_>) -> std::io::Result<()> {
    let (n, m) = (state.params.len(), state.m.len());
    let version = match m == n {
        true => VERSION_ALL_TRAIN,
        false => VERSION,
    };
    out.write_all(MAGIC)?;
    out.write_all(&version.to_le_bytes())?;
    out.write_all(&state.step.to_le_bytes())?;
    out.write_all(&state.dense_step.to_le_bytes())?;
    out.write_all(&(n as u64).to_le_bytes())?;
    if version == VERSION {
        out.write_all(&(m as u64).to_le_bytes())?;
    }
    let mut bytes = Vec::with_capacity(BUFFER_BYTES);
    for values in [state.params, state.m, state.v] {
        for chunk in values.chunks(BUFFER_BYTES / 4) {
            bytes.clear();
            bytes.extend(chunk.iter().flat_map(|x| x.to_le_bytes()));
            out.write_all(&bytes)?;
        }
    }
    Ok(())
}

/// Reads step `step`'s dense file for `count` params of which `trainable`
/// carry moments (`None`: as many as the file holds).
pub(crate) fn read(
    store: &Path,
    step: u64,
    count: usize,
    trainable: Option<usize>,
) -> Result<DenseState, EngineError> {
    let path = path_for(store, step);
    let bytes = std::fs::read(&path).map_err(|e| EngineError::File {
        path: path.clone(),
        why: format!("{e}; the store's committed step {step} needs its dense-state file"),
    })?;
    let bad = |why: &str| EngineError::File {
        path: path.clone(),
        why: why.to_string(),
    };
    if bytes.len() < 40 {
        return Err(bad(&format!(
            "{} bytes: too short for a dense-state file",
            bytes.len()
        )));
    }
    let (body, tail) = bytes.split_at(bytes.len() - 4);
    if crc32c::crc32c(body) != u32::from_le_bytes(tail.try_into().expect("4 bytes")) {
        return Err(bad("checksum mismatch (the file is damaged)"));
    }
    let u64_at = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().expect("8 bytes"));
    let version = u32::from_le_bytes(body[8..12].try_into().expect("4 bytes"));
    if &body[..8] != MAGIC || !(version == VERSION_ALL_TRAIN || version == VERSION) {
        return Err(bad("not a strata dense-state file of version 1 or 2"));
    }
    if version == VERSION && body.len() < 44 {
        return Err(bad("too short for a dense-state file of version 2"));
    }
    let (moments, header) = match version {
        VERSION_ALL_TRAIN => (u64_at(28), 36),
        _ => (u64_at(36), 44),
    };
    if u64_at(12) != step || u64_at(28) != count as u64 {
        return Err(bad(
            "step or parameter count differs from the store and model",
        ));
    }
    if moments > count as u64 {
        return Err(bad(&format!(
            "Adam moments for {moments} of {count} dense params"
        )));
    }
    let trainable = trainable.unwrap_or(moments as usize);
    if moments != trainable as u64 {
        return Err(bad(&format!(
            "it holds Adam moments for {moments} of the {count} dense params, but {trainable} \
             train now (the frozen tensors differ from the run's: resume with the same --train)"
        )));
    }
    let expected_len = header + 4 * count + 8 * trainable + 4;
    if bytes.len() != expected_len {
        return Err(bad(&format!(
            "{} bytes, {expected_len} expected for this model",
            bytes.len()
        )));
    }
    let floats = |at: usize, n: usize| -> Vec<f32> {
        body[at..at + 4 * n]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    let m_at = header + 4 * count;
    Ok(DenseState {
        step,
        dense_step: u64_at(20),
        params: floats(header, count),
        m: floats(m_at, trainable),
        v: floats(m_at + 4 * trainable, trainable),
    })
}

/// Removes the dense files of steps other than those in `keep`.
pub(crate) fn remove_others(store: &Path, keep: &[u64]) {
    let Some(dir) = store.parent() else { return };
    let Some(prefix) = store
        .file_name()
        .map(|n| format!("{}.dense-", n.to_string_lossy()))
    else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    }) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        if let Some(step) = name
            .strip_prefix(&prefix)
            .and_then(|s| s.parse::<u64>().ok())
        {
            if !keep.contains(&step) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}
