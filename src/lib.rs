//! strata: a storage-tiered expert offload engine for training
//! Mixture-of-Experts models larger than GPU memory.

pub mod bench;
pub mod cli;
mod error;
pub mod math;
pub mod model;
pub mod reference;

pub use error::EngineError;
