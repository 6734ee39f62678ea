//! Experts' gradients coming down from a GPU into page-locked buffers, so
//! that the copy is asynchronous for the host (a copy into pageable memory
//! returns only once it has ended, and runs at about half the rate) and the
//! CPU AdamW that reads a gradient is the one to wait for it
//! ([`ArrivingGradient`]).
//!
//! A GPU keeps at most [`GRADIENT_DOWNLOAD_BUFFERS`] of them, made at first
//! need and kept for the run. The next copy into a buffer handed back waits
//! on the device for the last one's event (cudarc orders copies into a
//! `PinnedHostSlice` after its earlier use), so a buffer can be handed back
//! before its copy has ended.

use std::sync::{Arc, Mutex, MutexGuard};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, PinnedHostSlice};

use super::gpu_error;
use crate::backend::{ArrivingGradient, Download, GRADIENT_DOWNLOAD_BUFFERS};
use crate::EngineError;

/// One GPU's page-locked gradient buffers.
pub(super) struct GradientBuffers {
    ctx: Arc<CudaContext>,
    /// The buffers not in use.
    free: Mutex<Vec<PinnedHostSlice<f32>>>,
    /// Buffers made so far, at most [`GRADIENT_DOWNLOAD_BUFFERS`].
    made: Mutex<usize>,
}

impl GradientBuffers {
    pub fn new(ctx: Arc<CudaContext>) -> Arc<Self> {
        Arc::new(Self {
            ctx,
            free: Mutex::new(Vec::with_capacity(GRADIENT_DOWNLOAD_BUFFERS)),
            made: Mutex::new(0),
        })
    }

    fn free(&self) -> MutexGuard<'_, Vec<PinnedHostSlice<f32>>> {
        // A push or a pop leaves the list valid after any panic.
        self.free.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A free buffer of `len` f32, or a new one while fewer than the bound
    /// exist; `None` when every one is in use.
    fn take(&self, len: usize) -> Result<Option<PinnedHostSlice<f32>>, EngineError> {
        {
            let mut free = self.free();
            if let Some(at) = free.iter().position(|b| b.len() == len) {
                return Ok(Some(free.swap_remove(at)));
            }
        }
        let mut made = self.made.lock().unwrap_or_else(|p| p.into_inner());
        if *made >= GRADIENT_DOWNLOAD_BUFFERS {
            return Ok(None);
        }
        // Flags 0: cached, not write-combined, as the CPU AdamW reads every
        // value.
        // SAFETY: the buffer's values are only read after a copy has
        // written all `len` of them (`Landing::wait`).
        let buffer = unsafe { self.ctx.alloc_pinned_with_flags::<f32>(len, 0) }
            .map_err(|e| gpu_error(&format!("allocating a {len}-value gradient buffer"), e))?;
        *made += 1;
        Ok(Some(buffer))
    }

    fn give(&self, buffer: PinnedHostSlice<f32>) {
        self.free().push(buffer);
    }
}

/// Queues `grad`'s copy on `stream` (which already waits for the backward
/// that wrote it) into one of `buffers`, or hands it back when none is
/// free. `grad` is freed in the stream's order, after the copy.
pub(super) fn start_download(
    buffers: &Arc<GradientBuffers>,
    stream: &Arc<CudaStream>,
    grad: CudaSlice<f32>,
    unmoved: impl FnOnce(CudaSlice<f32>) -> Download,
) -> Result<Download, EngineError> {
    let Some(mut buffer) = buffers.take(grad.len())? else {
        return Ok(unmoved(grad));
    };
    let queued = stream.memcpy_dtoh(&grad, &mut buffer);
    let landing = Landing {
        buffer: Some(buffer),
        buffers: Arc::clone(buffers),
        landed: false,
    };
    queued.map_err(|e| gpu_error("queuing an expert gradient's download", e))?;
    Ok(Download::Started(Box::new(landing)))
}

/// A gradient whose copy into a page-locked buffer is queued.
struct Landing {
    /// Taken back into `buffers` on drop.
    buffer: Option<PinnedHostSlice<f32>>,
    buffers: Arc<GradientBuffers>,
    /// `wait` has seen the copy end.
    landed: bool,
}

impl Landing {
    fn buffer(&self) -> &PinnedHostSlice<f32> {
        self.buffer.as_ref().expect("held until dropped")
    }
}

impl ArrivingGradient for Landing {
    fn wait(&mut self) -> Result<(), EngineError> {
        if !self.landed {
            // `as_slice` waits for the buffer's event, recorded behind
            // the copy.
            self.buffer()
                .as_slice()
                .map_err(|e| gpu_error("an expert gradient's download", e))?;
            self.landed = true;
        }
        Ok(())
    }

    fn values(&self) -> &[f32] {
        assert!(self.landed, "a gradient read before it landed");
        // The copy has ended, so this returns at once.
        let values = self.buffer().as_slice();
        values.expect("a landed copy's event stays complete")
    }
}

impl Drop for Landing {
    fn drop(&mut self) {
        if let Some(buffer) = self.buffer.take() {
            self.buffers.give(buffer);
        }
    }
}
