//! strata: a storage-tiered expert offload engine for training
//! Mixture-of-Experts models larger than GPU memory.

pub mod backend;
pub mod bench;
pub mod cli;
pub mod comm;
pub mod engine;
mod error;
pub mod lm;
pub mod math;
pub mod model;
mod parallel;
pub mod placement;
pub mod reference;
pub mod trainer;

pub use error::EngineError;
pub use parallel::{machine_cores, set_compute_threads, MAX_THREADS_PER_CORE};
