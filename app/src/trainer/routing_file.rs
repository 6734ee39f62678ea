//! `--trace-routing FILE`: the run's routing trace (how tokens move between
//! consecutive MoE layers' experts, `strata::engine::RoutingTrace`),
//! written just before every checkpoint commits, so that it covers the
//! checkpointed steps exactly, and continued by a resumed run. The trace
//! of the checkpoint before stays beside it as `FILE.prev`: a run stopped
//! between the trace and the commit, or ranks rolled back one checkpoint,
//! resume from that one. On ranks as processes every rank traces its own
//! tokens, and rank 0 writes their sum.

use std::path::{Path, PathBuf};

use strata::engine::{Engine, RoutingTrace};

/// `FILE.prev`: the trace of the checkpoint before.
fn previous(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".prev");
    PathBuf::from(name)
}

fn read(path: &Path) -> Result<Option<RoutingTrace>, String> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| format!("{} is not a routing trace: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("cannot read {}: {e}", path.display())),
    }
}

/// Continues the trace of the checkpoint the engine resumed from, `path`'s
/// or `path.prev`'s; none written yet starts one. A trace that covers
/// other steps is refused. On ranks, rank 0 takes it (the others count
/// their tokens from here, and rank 0 adds them in).
pub(super) fn resume(engine: &mut Engine, path: &Path) -> Result<(), String> {
    if engine.rank().is_some_and(|(r, _)| r != 0) {
        return Ok(());
    }
    let step = engine.steps();
    let mut found = Vec::new();
    for candidate in [path.to_path_buf(), previous(path)] {
        match read(&candidate)? {
            Some(trace) if trace.steps == step => {
                return engine
                    .set_routing_trace(trace)
                    .map_err(|e| format!("{}: {e}", candidate.display()));
            }
            Some(trace) => found.push(format!("{} {}", candidate.display(), trace.steps)),
            None => {}
        }
    }
    if found.is_empty() {
        return Ok(());
    }
    Err(format!(
        "the routing traces beside the run cover other steps ({}) than the checkpoint, at \
         step {step}: give another --trace-routing to start a new trace",
        found.join(" and ")
    ))
}

/// Writes the trace of every rank's tokens to `path` (under a temporary
/// name, renamed), the one there before kept as `path.prev`. A collective
/// on ranks: every rank calls it, rank 0 writes.
pub(super) fn write(engine: &mut Engine, path: &Path) -> Result<(), String> {
    let Some(trace) = engine.routing_trace_of_ranks().map_err(|e| e.to_string())? else {
        return Ok(());
    };
    if engine.rank().is_some_and(|(r, _)| r != 0) {
        return Ok(());
    }
    let cannot = |e: std::io::Error| format!("cannot write {}: {e}", path.display());
    if path.exists() {
        std::fs::rename(path, previous(path)).map_err(cannot)?;
    }
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, trace.to_json())
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(cannot)
}
