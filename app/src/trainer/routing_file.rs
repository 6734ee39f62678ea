//! `--trace-routing FILE`: the run's routing trace (how tokens move between
//! consecutive MoE layers' experts, `strata::engine::RoutingTrace`),
//! written with every checkpoint, so that it covers the checkpointed steps
//! exactly, and continued by a resumed run.

use std::path::Path;

use strata::engine::{Engine, RoutingTrace};

/// Continues the trace in `path` if a checkpoint wrote one; a trace that
/// does not cover the checkpoint's steps is refused.
pub(super) fn resume(engine: &mut Engine, path: &Path) -> Result<(), String> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let trace: RoutingTrace = serde_json::from_str(&text)
        .map_err(|e| format!("{} is not a routing trace: {e}", path.display()))?;
    if trace.steps != engine.steps() {
        return Err(format!(
            "{} traces {} steps but the checkpoint is at step {}: give another \
             --trace-routing to start a new trace",
            path.display(),
            trace.steps,
            engine.steps()
        ));
    }
    engine
        .set_routing_trace(trace)
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Writes the engine's trace to `path` (under a temporary name, renamed).
pub(super) fn write(engine: &Engine, path: &Path) -> Result<(), String> {
    let Some(trace) = engine.routing_trace() else {
        return Ok(());
    };
    let tmp = path.with_extension("partial");
    std::fs::write(&tmp, trace.to_json())
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}
