//! The engine's error type.

use strata_optim::OptimError;
use strata_tiers::TierError;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("invalid batch: {0}")]
    Batch(String),
    /// Training data that cannot be read, or is not what its name says
    /// (the message names the file, and the line where there is one).
    #[error("{0}")]
    Data(String),
    #[error("the loss is {loss}: training diverged (lower the learning rate, or check the data)")]
    NonFiniteLoss { loss: f32 },
    #[error(transparent)]
    Tier(#[from] TierError),
    #[error(transparent)]
    Optim(#[from] OptimError),
    #[error(transparent)]
    Comm(#[from] crate::comm::CommError),
    #[error("device {device}: {why}")]
    Device { device: usize, why: String },
    /// A file of the engine's own (a dense-state file) that cannot be read
    /// or written, or is damaged: names the file and what is wrong.
    #[error("{}: {why}", path.display())]
    File {
        path: std::path::PathBuf,
        why: String,
    },
}
