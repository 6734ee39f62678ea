//! `strata-tiers`: the three-tier expert store.
//!
//! - SSD: [`ExpertStore`], one crash-safe file with a fixed-size, 4096-aligned
//!   record per expert (format in `docs/formats.md`), read and written through
//!   io_uring with O_DIRECT, or pread/pwrite where io_uring is refused.
//! - Host: [`HostCache`], fixed-size slots carved from one allocation sized
//!   by `host_budget_bytes`, with pin counts, dirty tracking, LRU or
//!   schedule-distance eviction, and a prefetcher that walks the access
//!   schedule ahead of compute.
//! - Device: the [`DeviceArena`] trait (byte-budgeted slots, async copies
//!   with completion events) and its CPU implementation.
//!
//! The crate knows nothing of MoE math: an expert is an [`ExpertId`] and a
//! number of params.

#[cfg(not(target_endian = "little"))]
compile_error!("the store format is little-endian; big-endian hosts are not supported");

mod busy;
mod cache;
mod device;
#[cfg(feature = "cuda")]
pub mod device_cuda;
mod error;
pub mod format;
pub mod io;
mod prefetch;
mod record;
mod schedule;
mod store;
mod sys;
pub mod timeline;
mod verify;

pub use cache::{
    CacheStats, EvictionPolicy, HostCache, HostCacheConfig, ReadGuard, WriteGuard,
    MIN_STREAMING_SLOTS,
};
pub use device::{
    CopyEvent, CpuDeviceArena, DeviceArena, Download, HostBytes, HostBytesMut, SlotView,
};
pub use error::{Part, TierError};
pub use format::{Dtype, Layout};
pub use record::{compute_bytes, encode_compute, record_mut, Parts, RecordMut};
pub use store::ExpertStore;
pub use timeline::{Timeline, TimelineEvent, TimelineRecord, TimelineSpan};

pub use strata_core::ExpertId;
