//! strata: a storage-tiered expert offload engine for training
//! Mixture-of-Experts models larger than GPU memory.
//!
//! The example of the README: one step of the `tiny` language model with
//! its experts in a store file, and a checkpoint.
//!
//! ```no_run
//! use strata::engine::{Engine, EngineConfig};
//! use strata::lm::{LmConfig, MoeLm, TokenBatch};
//!
//! fn main() -> Result<(), strata::EngineError> {
//!     let lm = MoeLm::new(LmConfig::preset("tiny")?)?;
//!     let mut engine = Engine::new_network(&lm, EngineConfig {
//!         store_path: Some("/nvme/experts.strata".into()), // the SSD tier (None: in memory)
//!         device_budget_bytes: 64 << 20,                   // expert slots on the device
//!         host_budget_bytes: 256 << 20,                    // expert records in host memory
//!         ..EngineConfig::default()
//!     })?;
//!     let batch = TokenBatch { seq_len: 16, tokens: vec![1; 4 * 17], loss_mask: None, doc_starts: None };
//!     let metrics = engine.step_network(&lm, &batch)?;     // one optimizer step
//!     println!("{}", metrics.to_json());                   // loss, stalls per tier, bytes moved
//!     engine.checkpoint()                                   // durable; Engine::resume_network reopens it
//! }
//! ```
//!
//! The same with `store_path: None` (the SSD tier in memory) runs here:
//!
//! ```
//! use strata::engine::{Engine, EngineConfig};
//! use strata::lm::{LmConfig, MoeLm, TokenBatch};
//!
//! let lm = MoeLm::new(LmConfig::preset("tiny").unwrap()).unwrap();
//! let mut engine = Engine::new_network(&lm, EngineConfig {
//!     device_budget_bytes: 64 << 20,
//!     host_budget_bytes: 256 << 20,
//!     ..EngineConfig::default()
//! })
//! .unwrap();
//! let batch = TokenBatch { seq_len: 16, tokens: vec![1; 4 * 17], loss_mask: None, doc_starts: None };
//! let metrics = engine.step_network(&lm, &batch).unwrap();
//! assert!(metrics.loss.is_finite());
//! ```

pub mod backend;
pub mod comm;
pub mod condense;
pub mod engine;
mod error;
pub mod lm;
pub mod math;
pub mod migration;
pub mod model;
mod parallel;
pub mod placement;
pub mod reference;

pub use error::EngineError;
pub use parallel::{compute_threads, machine_cores, set_compute_threads, MAX_THREADS_PER_CORE};
