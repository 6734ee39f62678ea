//! `strata-optim`: a SIMD CPU AdamW at the memory-bandwidth limit, and
//! [`ExpertOptimizer`], a fixed pool of threads that steps each expert the
//! moment its gradient lands.
//!
//! The crate knows nothing of MoE models: an expert is an opaque
//! [`ExpertId`] and a set of buffers ([`UpdateTarget`]).
//!
//! ```
//! use strata_optim::{adamw_step, AdamWHyper, CopyOut, GradRef, Kernel, StepScalars};
//! let hyper = AdamWHyper::default();
//! let (mut p, mut m, mut v) = (vec![1.0f32; 100], vec![0.0f32; 100], vec![0.0f32; 100]);
//! let grad = vec![0.5f32; 100];
//! let mut copy = vec![half::bf16::ZERO; 100];
//! let scalars = StepScalars::new(&hyper, 1, 1.0);
//! adamw_step(Kernel::detect(), &scalars, &mut p, &mut m, &mut v,
//!            GradRef::F32(&grad), CopyOut::Bf16(&mut copy)).unwrap();
//! assert!(p[0] < 1.0);
//! assert_eq!(copy[0], half::bf16::from_f32(p[0]));
//! ```

mod adamw;
mod error;
mod pool;
mod worker;

pub use adamw::{adamw_step, memory_sweep, AdamWHyper, CopyOut, GradRef, Kernel, StepScalars};
pub use error::OptimError;
pub use pool::{
    check_thread_count, ExpertOptimizer, GradientPolicy, GradientSummary, OptimizerConfig,
    UpdateReport, UpdateTarget, UpdateViews, MAX_THREADS_PER_CORE,
};

/// The expert an update belongs to (its layer and index).
pub use strata_core::ExpertId;
