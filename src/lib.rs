//! strata: a storage-tiered expert offload engine for training
//! Mixture-of-Experts models larger than GPU memory.

pub mod bench;
pub mod cli;
