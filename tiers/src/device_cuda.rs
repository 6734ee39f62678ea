//! The device tier on an NVIDIA GPU (feature `cuda`; CUDA is loaded at run
//! time, so this builds without it). One device allocation is carved into
//! equal expert slots from the budget at start; uploads run on their own
//! stream, downloads on another, each copy followed by an event; a
//! completion thread per stream waits for the events in order, then
//! completes the [`CopyEvent`] and drops the host buffer (unpinning a host
//! slot), so nothing on the hot path synchronizes the device.
//!
//! Host memory the copies read should be page-locked for the copies to be
//! asynchronous: [`register_host`] registers an existing allocation (the
//! host tier's slot region) with the driver rather than allocating
//! write-combined memory, so the CPU optimizer still reads it at full speed
//! and io_uring can still fill it. When the OS refuses to lock that much
//! (the memlock limit), the error says so, and
//! [`CudaDeviceArena::stage_uploads`] routes uploads through a few
//! page-locked staging buffers instead: a staging thread copies each source
//! into a free buffer and queues the device copy from there, so uploads
//! stay asynchronous to the caller.

use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, Receiver, Sender};
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaStream, DriverError};

use crate::device::{slots_for_budget, CopyEvent, DeviceArena, Download, HostBytes, HostBytesMut};
use crate::TierError;

mod pinned;

pub use pinned::{register_host, HostRegistration, PlainCopy};
use pinned::{StageJob, Stager};

/// The GPU a context was opened on.
#[derive(Clone, Debug)]
pub struct GpuInfo {
    pub ordinal: usize,
    pub name: String,
    pub total_bytes: usize,
}

/// Opens GPU `ordinal`, or says why there is none. The driver library is
/// looked for before any CUDA call (cudarc's loaders panic without it).
pub fn open_gpu(ordinal: usize) -> Result<(Arc<CudaContext>, GpuInfo), TierError> {
    // SAFETY: only tries to open the driver library by its known names.
    if !unsafe { sys::is_culib_present() } {
        return Err(TierError::NoGpu(
            "no CUDA driver found (libcuda.so is not on the library path)".into(),
        ));
    }
    let no_gpu = |what: &str, e: DriverError| TierError::NoGpu(format!("{what}: {e}"));
    let ctx = CudaContext::new(ordinal).map_err(|e| {
        let count = match e.0 {
            sys::CUresult::CUDA_ERROR_INVALID_DEVICE => result::device::get_count().ok(),
            _ => None,
        };
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        TierError::NoGpu(why_no_gpu(ordinal, &e, count, visible.as_deref()))
    })?;
    let info = GpuInfo {
        ordinal,
        name: ctx.name().map_err(|e| no_gpu("device name", e))?,
        total_bytes: ctx.total_mem().map_err(|e| no_gpu("device memory", e))?,
    };
    Ok((ctx, info))
}

/// Why GPU `ordinal` could not be opened, and what to do about it, for the
/// driver errors a user can fix. `count` is the number of GPUs the driver
/// sees (asked for when the ordinal is out of range); `visible` is
/// `CUDA_VISIBLE_DEVICES`.
fn why_no_gpu(
    ordinal: usize,
    e: &DriverError,
    count: Option<i32>,
    visible: Option<&str>,
) -> String {
    use sys::CUresult as R;
    let visible = match visible {
        Some(v) => format!("CUDA_VISIBLE_DEVICES is {v:?}"),
        None => "CUDA_VISIBLE_DEVICES is unset".to_string(),
    };
    match e.0 {
        R::CUDA_ERROR_STUB_LIBRARY => {
            "the libcuda.so found is the CUDA toolkit's stub (from a `stubs` folder on the \
             library path), which has no driver behind it: take that folder off \
             LD_LIBRARY_PATH, or put the driver's own folder (where libcuda.so.1 is \
             installed) ahead of it"
                .to_string()
        }
        R::CUDA_ERROR_NO_DEVICE => format!("the CUDA driver sees no GPU ({visible})"),
        R::CUDA_ERROR_INVALID_DEVICE => match count {
            Some(n) => format!(
                "GPU {ordinal} was asked for, but the CUDA driver sees {n} ({visible}): \
                 ask for at most {n} device(s)"
            ),
            None => format!("there is no CUDA device {ordinal} ({visible})"),
        },
        R::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH => format!(
            "CUDA device {ordinal}: the NVIDIA kernel module and the libcuda.so found are \
             different driver versions: load the matching libcuda (or reboot after a driver \
             update)"
        ),
        _ => format!("CUDA device {ordinal}: {e}"),
    }
}

fn copy_error(what: &str, e: DriverError) -> TierError {
    TierError::DeviceCopy(format!("{what}: {e}"))
}

/// A copy whose event the completion thread waits for.
enum Pending {
    Upload {
        event: CudaEvent,
        /// Kept alive until the copy has read it.
        src: Box<dyn HostBytes>,
        done: CopyEvent,
    },
    Download {
        event: CudaEvent,
        done: CopyEvent,
    },
}

/// Copies in flight a stream's completion queue holds.
const COMPLETIONS_MAX: usize = 64;

/// A slot's two events, recorded again at each use, which order the
/// streams on the device: `landed` behind the last upload into the slot
/// (compute waits for it before reading the slot), `read` behind the last
/// work another stream queued on the slot's contents (the next upload
/// into the slot waits for it before writing). An event never recorded is
/// complete, so a first wait costs nothing.
struct SlotEvents {
    landed: CudaEvent,
    read: CudaEvent,
}

/// The device tier of one GPU.
pub struct CudaDeviceArena {
    ctx: Arc<CudaContext>,
    upload: Arc<CudaStream>,
    download: Arc<CudaStream>,
    base: sys::CUdeviceptr,
    slot_bytes: usize,
    /// Bytes from one slot's start to the next's: `slot_bytes` rounded up
    /// to `SLOT_ALIGN`.
    slot_stride: usize,
    slot_count: usize,
    /// One per slot: see [`SlotEvents`].
    events: Vec<SlotEvents>,
    uploads: Option<Sender<Pending>>,
    downloads: Option<Sender<Pending>>,
    /// Uploads staged through page-locked buffers (`stage_uploads`).
    staging: Option<Sender<StageJob>>,
    threads: Vec<JoinHandle<()>>,
}

/// Every slot starts on this boundary. cuBLAS picks its kernels by the
/// alignment of the operands as well as their shapes, so an expert must
/// find its weights equally aligned in whichever slot it lands: then its
/// GEMMs compute the same bits whatever the device budget.
pub const SLOT_ALIGN: usize = 256;

impl CudaDeviceArena {
    /// Carves `device_budget_bytes` of GPU memory into slots of
    /// `slot_bytes`, each starting on a `SLOT_ALIGN` boundary (the padding,
    /// under `SLOT_ALIGN` bytes a slot, comes on top of the budget).
    pub fn new(
        ctx: Arc<CudaContext>,
        device_budget_bytes: u64,
        slot_bytes: usize,
    ) -> Result<Self, TierError> {
        assert!(slot_bytes > 0);
        let slot_count = slots_for_budget(device_budget_bytes, slot_bytes)?;
        ctx.bind_to_thread()
            .map_err(|e| copy_error("binding the CUDA context", e))?;
        let slot_stride = slot_bytes.next_multiple_of(SLOT_ALIGN);
        let bytes = slot_count * slot_stride;
        // SAFETY: a plain allocation of `bytes`; freed once, in Drop, after
        // both streams have finished every copy into or out of it.
        let base = unsafe { result::malloc_sync(bytes) }.map_err(|e| {
            TierError::DeviceCopy(format!(
                "allocating {bytes} bytes of GPU memory for {slot_count} expert slots: {e} \
                 (lower the device budget)"
            ))
        })?;
        let stream = |what| ctx.new_stream().map_err(|e| copy_error(what, e));
        let upload = stream("creating the upload stream")?;
        let download = stream("creating the download stream")?;
        let event = || {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(|e| copy_error("creating a slot's event", e))
        };
        let events = (0..slot_count)
            .map(|_| {
                Ok(SlotEvents {
                    landed: event()?,
                    read: event()?,
                })
            })
            .collect::<Result<Vec<_>, TierError>>()?;
        let mut threads = Vec::new();
        let mut spawn = |name: &str| -> Result<Sender<Pending>, TierError> {
            let (tx, rx) = bounded::<Pending>(COMPLETIONS_MAX);
            let ctx = Arc::clone(&ctx);
            let handle = std::thread::Builder::new()
                .name(name.to_string())
                .spawn(move || completion_loop(&ctx, &rx))
                .map_err(|e| TierError::IoThread(e.to_string()))?;
            threads.push(handle);
            Ok(tx)
        };
        let uploads = spawn("strata-cuda-htod")?;
        let downloads = spawn("strata-cuda-dtoh")?;
        Ok(Self {
            ctx,
            upload,
            download,
            base,
            slot_bytes,
            slot_stride,
            slot_count,
            events,
            uploads: Some(uploads),
            downloads: Some(downloads),
            staging: None,
            threads,
        })
    }

    /// Routes every later upload through `buffers` page-locked staging
    /// buffers of one slot each, for sources that are not page-locked
    /// (where the OS refused to register the host tier's memory): a
    /// staging thread copies each source into a free buffer, releases the
    /// source, and queues the device copy from the buffer, so uploads stay
    /// asynchronous to their caller. Call it before any upload.
    pub fn stage_uploads(&mut self, buffers: usize) -> Result<(), TierError> {
        if self.staging.is_some() {
            return Ok(());
        }
        let completions = self.uploads.clone().expect("live until drop");
        let (tx, handle) = Stager::spawn(
            &self.ctx,
            &self.upload,
            buffers,
            self.slot_bytes,
            completions,
        )?;
        self.threads.push(handle);
        self.staging = Some(tx);
        Ok(())
    }

    /// Whether uploads go through staging buffers.
    pub fn is_staging(&self) -> bool {
        self.staging.is_some()
    }

    /// The device address of a slot (for kernels reading the expert).
    pub fn slot_ptr(&self, slot: usize) -> sys::CUdeviceptr {
        assert!(slot < self.slot_count);
        self.base + (slot * self.slot_stride) as u64
    }

    /// The stream uploads run on (compute waits on its events).
    pub fn upload_stream(&self) -> &Arc<CudaStream> {
        &self.upload
    }

    /// Whether work on another stream may read a slot as soon as
    /// [`Self::read_after_upload`] has ordered it, without the host waiting
    /// for the upload's [`CopyEvent`]: true unless uploads are staged, where
    /// the staging thread queues each device copy later than the upload
    /// call returns.
    pub fn orders_uploads_on_device(&self) -> bool {
        self.staging.is_none()
    }

    /// Makes `stream`'s later work wait, on the device, for the last upload
    /// into `slot` (its bytes complete there). No host wait. With staged
    /// uploads the host must also wait for the upload's [`CopyEvent`]
    /// first ([`Self::orders_uploads_on_device`]).
    ///
    /// Calls for one slot come from one thread at a time, in the order the
    /// engine issues its uploads and computes.
    pub fn read_after_upload(&self, slot: usize, stream: &CudaStream) -> Result<(), TierError> {
        self.check(slot, 0, "a read of a device slot")?;
        stream
            .wait(&self.events[slot].landed)
            .map_err(|e| copy_error("ordering a read after its slot's upload", e))
    }

    /// Marks `slot` as read by the work queued on `stream` so far: the next
    /// upload into the slot waits for that work on the device, so the host
    /// may start it at once.
    pub fn release_after(&self, slot: usize, stream: &CudaStream) -> Result<(), TierError> {
        self.check(slot, 0, "a release of a device slot")?;
        self.events[slot]
            .read
            .record(stream)
            .map_err(|e| copy_error("recording a slot's last read", e))
    }

    fn check(&self, slot: usize, len: usize, what: &'static str) -> Result<(), TierError> {
        if slot >= self.slot_count {
            return Err(TierError::DeviceCopy(format!("no device slot {slot}")));
        }
        if len > self.slot_bytes {
            return Err(TierError::BufferSize {
                what,
                expected: self.slot_bytes,
                got: len,
            });
        }
        Ok(())
    }
}

/// Waits for each copy's event in submission order and completes it.
fn completion_loop(ctx: &Arc<CudaContext>, rx: &Receiver<Pending>) {
    let bound = ctx.bind_to_thread();
    for pending in rx.iter() {
        let (event, done, src) = match pending {
            Pending::Upload { event, src, done } => (event, done, Some(src)),
            Pending::Download { event, done } => (event, done, None),
        };
        let result = match &bound {
            Err(e) => Err(format!("binding the CUDA context: {e}")),
            Ok(()) => event
                .synchronize()
                .map_err(|e| format!("a device copy failed: {e}")),
        };
        drop(src); // the copy has read it (or failed)
        done.complete(result.err());
    }
}

impl DeviceArena for CudaDeviceArena {
    fn kind(&self) -> &'static str {
        "cuda"
    }

    fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slot_count(&self) -> usize {
        self.slot_count
    }

    fn upload_htod(&self, slot: usize, src: Box<dyn HostBytes>) -> Result<CopyEvent, TierError> {
        self.check(slot, src.bytes().len(), "an upload into a device slot")?;
        // Not before the work that still reads the slot's last contents.
        self.upload
            .wait(&self.events[slot].read)
            .map_err(|e| copy_error("ordering an upload after its slot's last read", e))?;
        if let Some(staging) = &self.staging {
            let done = CopyEvent::new();
            staging
                .send(StageJob {
                    dst: self.slot_ptr(slot),
                    src,
                    done: done.clone(),
                })
                .map_err(|_| TierError::IoThread("the upload staging thread stopped".into()))?;
            return Ok(done);
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| copy_error("binding the CUDA context", e))?;
        // SAFETY: the destination range lies inside the allocation (checked
        // above); `src`'s bytes live on the heap (or in the host tier's
        // region) and `src` is dropped by the completion thread only after
        // the event recorded behind this copy has completed.
        unsafe {
            result::memcpy_htod_async(self.slot_ptr(slot), src.bytes(), self.upload.cu_stream())
        }
        .map_err(|e| copy_error("an upload", e))?;
        self.events[slot]
            .landed
            .record(&self.upload)
            .map_err(|e| copy_error("recording a slot's upload", e))?;
        let event = self
            .upload
            .record_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(|e| copy_error("recording an upload's event", e))?;
        let done = CopyEvent::new();
        self.uploads
            .as_ref()
            .expect("live until drop")
            .send(Pending::Upload {
                event,
                src,
                done: done.clone(),
            })
            .map_err(|_| TierError::IoThread("the upload completion thread stopped".into()))?;
        Ok(done)
    }

    fn download_dtoh(
        &self,
        slot: usize,
        mut dst: Box<dyn HostBytesMut>,
    ) -> Result<Download, TierError> {
        let len = dst.bytes_mut().len().min(self.slot_bytes);
        self.check(slot, len, "a download from a device slot")?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| copy_error("binding the CUDA context", e))?;
        self.read_after_upload(slot, &self.download)?;
        {
            let out = &mut dst.bytes_mut()[..len];
            // SAFETY: the source range lies inside the allocation; `out`
            // lives on the heap inside `dst`, which nobody can reach until
            // `Download::wait` returns, after the copy's event completed.
            unsafe {
                result::memcpy_dtoh_async(out, self.slot_ptr(slot), self.download.cu_stream())
            }
            .map_err(|e| copy_error("a download", e))?;
        }
        let event = self
            .download
            .record_event(Some(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC))
            .map_err(|e| copy_error("recording a download's event", e))?;
        let done = CopyEvent::new();
        self.downloads
            .as_ref()
            .expect("live until drop")
            .send(Pending::Download {
                event,
                done: done.clone(),
            })
            .map_err(|_| TierError::IoThread("the download completion thread stopped".into()))?;
        Ok(Download {
            event: done,
            dst: Arc::new(Mutex::new(Some(dst))),
        })
    }
}

impl Drop for CudaDeviceArena {
    fn drop(&mut self) {
        // Closing the queues ends the staging and completion threads after
        // the copies (the staging thread's own completion sender last).
        self.staging.take();
        self.uploads.take();
        self.downloads.take();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let _ = self.upload.synchronize();
        let _ = self.download.synchronize();
        // The slots' events before the streams they were recorded on.
        self.events.clear();
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated in `new`, freed once; both streams are idle.
            let _ = unsafe { result::free_sync(self.base) };
        }
    }
}

// SAFETY: the raw device pointer is only an address; every use goes
// through the context (bound on the calling thread first) and the streams,
// which the driver makes safe to use from several threads.
unsafe impl Send for CudaDeviceArena {}
// SAFETY: as for Send; `&self` methods only enqueue work on the streams.
unsafe impl Sync for CudaDeviceArena {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn driver_errors_a_user_can_fix_say_what_to_do() {
        use sys::CUresult as R;
        let stub = why_no_gpu(0, &DriverError(R::CUDA_ERROR_STUB_LIBRARY), None, None);
        assert!(
            stub.contains("stub") && stub.contains("LD_LIBRARY_PATH"),
            "{stub}"
        );
        let none = why_no_gpu(0, &DriverError(R::CUDA_ERROR_NO_DEVICE), None, Some(""));
        assert!(
            none.contains("sees no GPU") && none.contains("CUDA_VISIBLE_DEVICES is \"\""),
            "{none}"
        );
        let past = why_no_gpu(2, &DriverError(R::CUDA_ERROR_INVALID_DEVICE), Some(2), None);
        assert!(
            past.contains("GPU 2 was asked for, but the CUDA driver sees 2"),
            "{past}"
        );
        assert!(past.contains("at most 2 device(s)"), "{past}");
        let mismatch = why_no_gpu(
            0,
            &DriverError(R::CUDA_ERROR_SYSTEM_DRIVER_MISMATCH),
            None,
            None,
        );
        assert!(mismatch.contains("different driver versions"), "{mismatch}");
        // (Other errors print the driver's own string, which needs the
        // driver library; these cases name what to change instead.)
    }
}
