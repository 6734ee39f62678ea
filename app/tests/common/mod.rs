//! The engine tests' helpers (`tests/common`, shared as they are), and
//! trainer flags for the tiny model of `tiny_lm`.

// Each test binary uses its own subset.
#![allow(dead_code, unused_imports)]

#[path = "../../../tests/common/mod.rs"]
mod engine;
mod flags;
pub mod ranks;

pub use engine::*;

/// The tiny model, with the trainer flags that stream its experts from
/// the SSD.
pub mod tiny_lm {
    pub use super::engine::tiny_lm::*;
    pub use super::flags::{flags_holding, flags_holding_for, small_flags, small_flags_on};
}

/// Sends `signal` (`INT`, `TERM`) to our own child, not yet reaped.
pub fn signal(child: &std::process::Child, signal: &str) {
    let sent = std::process::Command::new("kill")
        .args([format!("-{signal}"), child.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
}
