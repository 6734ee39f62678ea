//! The dense part of a checkpoint: dense params, their Adam moments and
//! step, in `<store>.dense-<step>` beside the store file. It is written
//! (under a temporary name, fsynced, renamed) before the store commits the
//! same step, so the store's committed step always has its dense file.
//!
//! Layout (little-endian): magic `STRATADN`, u32 version 1, u64 step,
//! u64 dense AdamW step, u64 count N, N f32 params, N f32 m, N f32 v,
//! u32 CRC-32C of everything before it (`docs/formats.md`).

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::EngineError;

const MAGIC: &[u8; 8] = b"STRATADN";
const VERSION: u32 = 1;

pub(crate) struct DenseState {
    pub step: u64,
    pub dense_step: u64,
    pub params: Vec<f32>,
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

pub(crate) fn write(store: &Path, state: &DenseState) -> Result<(), EngineError> {
    let path = path_for(store, state.step);
    let mut bytes = Vec::with_capacity(36 + 12 * state.params.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&VERSION.to_le_bytes());
    bytes.extend_from_slice(&state.step.to_le_bytes());
    bytes.extend_from_slice(&state.dense_step.to_le_bytes());
    bytes.extend_from_slice(&(state.params.len() as u64).to_le_bytes());
    for values in [&state.params, &state.m, &state.v] {
        for x in values.iter() {
            bytes.extend_from_slice(&x.to_le_bytes());
        }
    }
    let crc = crc32c::crc32c(&bytes);
    bytes.extend_from_slice(&crc.to_le_bytes());
    let tmp = path.with_extension("partial");
    let mut file = std::fs::File::create(&tmp).map_err(|e| io_error(&tmp, e))?;
    file.write_all(&bytes).map_err(|e| io_error(&tmp, e))?;
    file.sync_all().map_err(|e| io_error(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| io_error(&path, e))?;
    if let Some(dir) = path.parent() {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}

pub(crate) fn read(store: &Path, step: u64, count: usize) -> Result<DenseState, EngineError> {
    let path = path_for(store, step);
    let bytes = std::fs::read(&path).map_err(|e| EngineError::File {
        path: path.clone(),
        why: format!("{e}; the store's committed step {step} needs its dense-state file"),
    })?;
    let bad = |why: &str| EngineError::File {
        path: path.clone(),
        why: why.to_string(),
    };
    let expected_len = 36 + 12 * count + 4;
    if bytes.len() != expected_len {
        return Err(bad(&format!(
            "{} bytes, {expected_len} expected for this model",
            bytes.len()
        )));
    }
    let (body, tail) = bytes.split_at(bytes.len() - 4);
    if crc32c::crc32c(body) != u32::from_le_bytes(tail.try_into().expect("4 bytes")) {
        return Err(bad("checksum mismatch (the file is damaged)"));
    }
    if &body[..8] != MAGIC || body[8..12] != VERSION.to_le_bytes() {
        return Err(bad("not a strata dense-state file of version 1"));
    }
    let u64_at = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().expect("8 bytes"));
    if u64_at(12) != step || u64_at(28) != count as u64 {
        return Err(bad(
            "step or parameter count differs from the store and model",
        ));
    }
    let floats = |k: usize| -> Vec<f32> {
        let at = 36 + 4 * count * k;
        body[at..at + 4 * count]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };
    Ok(DenseState {
        step,
        dense_step: u64_at(20),
        params: floats(0),
        m: floats(1),
        v: floats(2),
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
