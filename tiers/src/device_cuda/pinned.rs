//! Page-locked host memory for the device tier's uploads: registering an
//! existing allocation with the driver ([`register_host`]), or, where the
//! OS refuses, staging uploads through a few driver-allocated buffers
//! ([`Stager`], `CudaDeviceArena::stage_uploads`).

use std::ffi::c_void;
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Receiver, Sender};
use cudarc::driver::{result, sys, CudaContext, CudaStream};

use super::{copy_error, Pending, COMPLETIONS_MAX};
use crate::device::{CopyEvent, HostBytes};
use crate::io::RegionLease;
use crate::TierError;

/// Page-locked host memory from the driver (cuMemHostAlloc), zeroed at
/// allocation, freed on drop.
struct PinnedBuffer {
    ctx: Arc<CudaContext>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the buffer is plain host memory owned by this value alone.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    fn new(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, TierError> {
        ctx.bind_to_thread()
            .map_err(|e| copy_error("binding the CUDA context", e))?;
        // SAFETY: a plain allocation of `len` bytes, freed once, in Drop.
        let ptr =
            unsafe { result::malloc_host(len, sys::CU_MEMHOSTALLOC_PORTABLE) }.map_err(|e| {
                copy_error(
                    &format!("allocating a {len}-byte page-locked staging buffer"),
                    e,
                )
            })?;
        let ptr = ptr.cast::<u8>();
        // SAFETY: `ptr` addresses `len` writable bytes just allocated.
        unsafe { std::ptr::write_bytes(ptr, 0, len) };
        Ok(Self {
            ctx: Arc::clone(ctx),
            ptr,
            len,
        })
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` initialized bytes (zeroed in `new`), owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`; &mut self makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated in `new`, freed once; no copy reads it any
            // more (the completion thread drops it after the copy's event).
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}

/// A staging buffer holding an upload's bytes; handed back to its pool
/// when dropped (by the completion thread, once the copy has read it).
struct StagedBytes {
    buffer: Option<PinnedBuffer>,
    len: usize,
    pool: Sender<PinnedBuffer>,
}

impl HostBytes for StagedBytes {
    fn bytes(&self) -> &[u8] {
        &self.buffer.as_ref().expect("held until drop").as_slice()[..self.len]
    }
}

impl Drop for StagedBytes {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            // The pool has room for every buffer; once it is gone (the
            // arena is closing) the buffer is freed instead.
            let _ = self.pool.try_send(buffer);
        }
    }
}

/// An upload for the staging thread.
pub(super) struct StageJob {
    pub dst: sys::CUdeviceptr,
    pub src: Box<dyn HostBytes>,
    pub done: CopyEvent,
}

/// What the staging thread works with.
pub(super) struct Stager {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    free: Receiver<PinnedBuffer>,
    pool: Sender<PinnedBuffer>,
    completions: Sender<Pending>,
}

impl Stager {
    /// Starts the staging thread with `buffers` page-locked buffers of
    /// `slot_bytes` each, queueing its device copies on `stream` and their
    /// events to `completions`. Returns where to send its jobs.
    pub(super) fn spawn(
        ctx: &Arc<CudaContext>,
        stream: &Arc<CudaStream>,
        buffers: usize,
        slot_bytes: usize,
        completions: Sender<Pending>,
    ) -> Result<(Sender<StageJob>, JoinHandle<()>), TierError> {
        let buffers = buffers.max(1);
        let (pool, free) = bounded::<PinnedBuffer>(buffers);
        for _ in 0..buffers {
            let buffer = PinnedBuffer::new(ctx, slot_bytes)?;
            pool.send(buffer)
                .expect("the pool has room for every buffer");
        }
        let stager = Stager {
            ctx: Arc::clone(ctx),
            stream: Arc::clone(stream),
            free,
            pool,
            completions,
        };
        let (tx, jobs) = bounded::<StageJob>(COMPLETIONS_MAX);
        let handle = std::thread::Builder::new()
            .name("strata-cuda-stage".into())
            .spawn(move || stager.run(&jobs))
            .map_err(|e| TierError::IoThread(e.to_string()))?;
        Ok((tx, handle))
    }

    fn run(self, jobs: &Receiver<StageJob>) {
        let bound = self.ctx.bind_to_thread();
        for job in jobs.iter() {
            let done = job.done.clone();
            let staged = match &bound {
                Err(e) => Err(format!("binding the CUDA context: {e}")),
                Ok(()) => self.stage(job),
            };
            match staged {
                Ok(pending) => {
                    if self.completions.send(pending).is_err() {
                        done.complete(Some("the upload completion thread stopped".into()));
                        break;
                    }
                }
                Err(why) => done.complete(Some(why)),
            }
        }
    }

    /// Copies `job`'s bytes into a free staging buffer (waiting for one),
    /// releases the source, and queues the device copy from the buffer.
    fn stage(&self, job: StageJob) -> Result<Pending, String> {
        let buffer = self
            .free
            .recv()
            .map_err(|_| "the staging pool closed".to_string())?;
        let len = job.src.bytes().len();
        // Wrapped at once so that any early return hands the buffer back.
        let mut staged = StagedBytes {
            buffer: Some(buffer),
            len,
            pool: self.pool.clone(),
        };
        let buffer = staged.buffer.as_mut().expect("just set");
        buffer.as_mut_slice()[..len].copy_from_slice(job.src.bytes());
        drop(job.src); // its host slot is free again

        // SAFETY: `dst` lies inside the arena (checked by `upload_htod`);
        // the staging buffer is page-locked and is dropped only by the
        // completion thread after the event recorded behind this copy.
        unsafe { result::memcpy_htod_async(job.dst, staged.bytes(), self.stream.cu_stream()) }
            .map_err(|e| format!("a staged upload: {e}"))?;
        let event = self
            .stream
            .record_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(|e| format!("recording a staged upload's event: {e}"))?;
        Ok(Pending::Upload {
            event,
            src: Box::new(staged),
            done: job.done,
        })
    }
}

/// A host region registered with the driver as page-locked; unregistered
/// on drop, before the lease it holds lets the memory go.
pub struct HostRegistration {
    ctx: Arc<CudaContext>,
    ptr: *mut c_void,
    _lease: RegionLease,
}

// SAFETY: the pointer is only handed back to the driver on drop.
unsafe impl Send for HostRegistration {}

/// Page-locks the leased region (the host tier's slot region,
/// `HostCache::region`). When the OS refuses (the memlock limit), the error
/// names the limit; copies from unregistered memory still work.
pub fn register_host(
    ctx: &Arc<CudaContext>,
    lease: RegionLease,
) -> Result<HostRegistration, TierError> {
    let (ptr, len) = (lease.as_ptr(), lease.len());
    ctx.bind_to_thread()
        .map_err(|e| copy_error("binding the CUDA context", e))?;
    // SAFETY: the range is one live allocation, kept mapped by the lease
    // the registration holds until it is unregistered.
    let rc =
        unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, sys::CU_MEMHOSTREGISTER_PORTABLE) };
    if rc != sys::CUresult::CUDA_SUCCESS {
        let limit = crate::sys::memlock_limit();
        return Err(TierError::DeviceCopy(format!(
            "the OS refused to page-lock {len} bytes of host memory ({rc:?}; memlock limit \
             {limit}, see `ulimit -l`)"
        )));
    }
    Ok(HostRegistration {
        ctx: Arc::clone(ctx),
        ptr: ptr.cast(),
        _lease: lease,
    })
}

impl Drop for HostRegistration {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: registered in `register_host`, unregistered once.
            let _ = unsafe { sys::cuMemHostUnregister(self.ptr) };
        }
    }
}

/// A page-locked host buffer and a device buffer of the same size: the plain
/// host → device copy that `strata bench upload` measures the tier's
/// uploads against.
pub struct PlainCopy {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    host: *mut c_void,
    dev: sys::CUdeviceptr,
    bytes: usize,
}

impl PlainCopy {
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<Self, TierError> {
        ctx.bind_to_thread()
            .map_err(|e| copy_error("binding the CUDA context", e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| copy_error("creating a stream", e))?;
        // SAFETY: a fresh page-locked allocation of `bytes`, freed in Drop.
        let host = unsafe { result::malloc_host(bytes, 0) }
            .map_err(|e| copy_error("allocating page-locked host memory", e))?;
        // SAFETY: a fresh device allocation of `bytes`, freed in Drop.
        let dev = match unsafe { result::malloc_sync(bytes) } {
            Ok(dev) => dev,
            Err(e) => {
                // SAFETY: allocated just above, never used.
                let _ = unsafe { result::free_host(host) };
                return Err(copy_error("allocating device memory", e));
            }
        };
        Ok(Self {
            ctx: Arc::clone(ctx),
            stream,
            host,
            dev,
            bytes,
        })
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Copies the whole buffer host → device and waits for it.
    pub fn run(&self) -> Result<(), TierError> {
        // SAFETY: `host` holds `bytes` bytes until Drop, and nothing writes
        // them (they are only ever copied from).
        let src = unsafe { std::slice::from_raw_parts(self.host as *const u8, self.bytes) };
        // SAFETY: `dev` holds `bytes` bytes; the copy is waited for below,
        // before `src` can go.
        unsafe { result::memcpy_htod_async(self.dev, src, self.stream.cu_stream()) }
            .map_err(|e| copy_error("the plain copy", e))?;
        self.stream
            .synchronize()
            .map_err(|e| copy_error("the plain copy", e))
    }
}

impl Drop for PlainCopy {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated in `new`, freed once; the stream is idle.
            unsafe {
                let _ = result::free_sync(self.dev);
                let _ = result::free_host(self.host);
            }
        }
    }
}
