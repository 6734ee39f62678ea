//! The optimizer's one error type.

use crate::ExpertId;

/// Everything the optimizer can report. Programmer errors (a step number of
/// zero, a kernel asked for on the wrong CPU through the raw API) panic;
/// everything a caller can cause at run time is a variant here.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum OptimError {
    #[error("AdamW hyper-parameter {name} = {value} is out of range")]
    InvalidHyper { name: &'static str, value: f32 },
    #[error("{what} has {got} elements but params have {expected}")]
    LengthMismatch {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("expert {key}: {source}")]
    Expert {
        key: ExpertId,
        #[source]
        source: Box<OptimError>,
    },
    #[error("AdamW kernel {kernel} is not supported by this CPU; use Kernel::detect()")]
    KernelUnsupported { kernel: &'static str },
    #[error("invalid optimizer configuration: {0}")]
    InvalidConfig(String),
    #[error("expert {key} is already submitted and not yet waited for")]
    AlreadySubmitted { key: ExpertId },
    #[error("expert {key} was never submitted (or was already waited for)")]
    NotSubmitted { key: ExpertId },
    #[error(
        "{in_flight_max} experts are already in flight; wait for some first or raise in_flight_max"
    )]
    InFlightFull { in_flight_max: usize },
    #[error(
        "expert {key} waits for the global gradient norm: call finish_gradients() before wait()"
    )]
    AwaitingGradientNorm { key: ExpertId },
    #[error("its gradient never reached host memory: {0}")]
    GradientUnavailable(String),
    #[error("the update of expert {key} panicked: {message}")]
    UpdatePanicked { key: ExpertId, message: String },
    #[error("an optimizer worker thread panicked: {message}")]
    WorkerPanicked { message: String },
    #[error("the optimizer pool is shut down")]
    ShutDown,
}
