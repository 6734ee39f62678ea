//! strata: a storage-tiered expert offload engine for training
//! Mixture-of-Experts models larger than GPU memory.

pub mod backend;
pub mod comm;
pub mod engine;
mod error;
pub mod lm;
pub mod math;
pub mod model;
mod parallel;
pub mod placement;
pub mod reference;

pub use error::EngineError;
pub use parallel::{compute_threads, machine_cores, set_compute_threads, MAX_THREADS_PER_CORE};
