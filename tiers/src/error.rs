//! The tiers' one error type.

use std::io;
use std::path::PathBuf;

use crate::ExpertId;

/// The two separately readable parts of a record.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Part {
    /// The compute-precision params: what forward and backward read.
    Compute,
    /// f32 master params and the two Adam moments: what the optimizer reads.
    State,
}

impl std::fmt::Display for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Part::Compute => "compute params",
            Part::State => "optimizer state",
        })
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TierError {
    #[error("{op} at byte {offset} of the store failed: {source}")]
    Io {
        op: &'static str,
        offset: u64,
        #[source]
        source: io::Error,
    },
    #[error(
        "an earlier {op} failed ({message}); the store refuses further I/O so nothing is \
         half-written silently; reopen it to recover the last committed checkpoint"
    )]
    PreviousIo { op: &'static str, message: String },
    #[error("{path}: {source}")]
    File {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("expert {expert}: {what} checksum mismatch in its {part} (the store file is damaged)")]
    Checksum {
        expert: ExpertId,
        part: Part,
        what: &'static str,
    },
    #[error("expert {expert}: {what} in its {part} (the store file is damaged)")]
    CorruptRecord {
        expert: ExpertId,
        part: Part,
        what: &'static str,
    },
    #[error("expert {expert} has never been written to this store")]
    NeverWritten { expert: ExpertId },
    #[error("expert {expert} does not exist: the store has {layers} layers of {experts_per_layer} experts")]
    NoSuchExpert {
        expert: ExpertId,
        layers: u32,
        experts_per_layer: u32,
    },
    #[error("not a strata store: {0}")]
    NotAStore(String),
    #[error("the store cannot roll back: {0}")]
    RollBack(String),
    #[error("the store's superblock is damaged: {0}")]
    CorruptSuperblock(&'static str),
    #[error(
        "store format version {found} is not supported (this build reads version {supported})"
    )]
    UnsupportedVersion { found: u32, supported: u32 },
    #[error("the store is truncated: {actual} bytes, its layout needs {expected}")]
    Truncated { expected: u64, actual: u64 },
    #[error("the store's layout is {found}, but {expected} was asked for")]
    LayoutMismatch { found: String, expected: String },
    #[error("invalid layout: {0}")]
    InvalidLayout(String),
    #[error(
        "the {tier} budget of {budget_bytes} bytes is below the {needed_bytes} bytes it needs \
         ({why}); raise it to at least {needed_bytes}"
    )]
    BudgetTooSmall {
        tier: &'static str,
        budget_bytes: u64,
        needed_bytes: u64,
        why: &'static str,
    },
    #[error("buffer of {got} bytes where {expected} are needed for {what}")]
    BufferSize {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error(
        "{kept} experts to keep resident in {slots} host slots: at least {streaming} must stay \
         free to stream the others; keep fewer or raise the host budget"
    )]
    TooManyKept {
        kept: usize,
        slots: usize,
        streaming: usize,
    },
    #[error("all {slots} host slots are pinned; release a guard or raise the host budget")]
    AllSlotsPinned { slots: usize },
    #[error("expert {expert} is dirty and still held by a write guard; drop the guard before a flush or checkpoint")]
    DirtyExpertHeld { expert: ExpertId },
    #[error("no GPU to use: {0}; the cpu backend needs none")]
    NoGpu(String),
    #[error("device tier: {0}")]
    DeviceCopy(String),
    #[error("import: {0}")]
    Import(String),
    #[error("the background I/O thread stopped: {0}")]
    IoThread(String),
}

impl TierError {
    pub(crate) fn io(op: &'static str, offset: u64, source: io::Error) -> Self {
        TierError::Io { op, offset, source }
    }
}
