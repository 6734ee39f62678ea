//! A compute device as the engine drives it: its device tier (an arena of
//! expert slots, filled by asynchronous uploads) together with the expert
//! FFN computed from the params in a slot, where they lie. The cpu device
//! (`cpu_device.rs`) runs the cpu backend's FFN on a slot's params; the
//! cuda device (`cuda/expert.rs`) points cuBLAS at the slot in GPU memory.

use std::sync::Arc;

use strata_tiers::io::HostRegion;
use strata_tiers::{DeviceArena, Dtype, Layout};

use crate::math::{ExpertKind, ExpertSaved};
use crate::model::DenseKernels;
use crate::EngineError;

/// An expert's compute params in a device slot: `count` values of `dtype`
/// from the slot's start (w1, w3, w2 as `math::ExpertKind` lays them out).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotParams {
    pub slot: usize,
    pub dtype: Dtype,
    pub count: usize,
}

impl SlotParams {
    pub fn new(layout: &Layout, slot: usize) -> Self {
        Self {
            slot,
            dtype: layout.compute_dtype,
            count: layout.params_per_expert as usize,
        }
    }
}

/// `len` f32 values at address `ptr` of a device's own memory: rows of
/// activations a GPU keeps for its experts to read and write in place
/// ([`ExpertDevice::expert_forward_rows`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRows {
    pub ptr: u64,
    pub len: usize,
}

impl DeviceRows {
    pub fn new(ptr: u64, len: usize) -> Self {
        Self { ptr, len }
    }

    /// Rows `rows` (of `width` values each) of these.
    pub fn rows(self, rows: std::ops::Range<usize>, width: usize) -> Self {
        assert!(rows.end * width <= self.len, "rows beyond the buffer");
        let at = (rows.start * width * std::mem::size_of::<f32>()) as u64;
        Self::new(self.ptr + at, rows.len() * width)
    }
}

/// One expert of a group a device computes from host rows in one call
/// ([`ExpertDevice::experts_forward`]): as [`ExpertDevice::expert_forward`]
/// takes them.
pub struct ExpertForward<'a> {
    pub params: SlotParams,
    pub x: &'a [f32],
    pub out: &'a mut [f32],
    pub saved: &'a mut ExpertSaved<f32>,
}

/// One expert of a group's backward from host rows in one call
/// ([`ExpertDevice::experts_backward`]): as [`ExpertDevice::expert_backward`]
/// takes them.
pub struct ExpertBackward<'a> {
    pub params: SlotParams,
    pub x: &'a [f32],
    pub dout: &'a [f32],
    pub saved: &'a ExpertSaved<f32>,
    pub dx: &'a mut [f32],
    pub dparams: &'a mut [f32],
}

/// One expert of a group a device computes in one call
/// ([`ExpertDevice::experts_forward_rows`]): its params in their slot, its
/// input rows `x` and its output rows `out`, (n, D) each in the device's
/// memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertForwardRows {
    pub params: SlotParams,
    pub x: DeviceRows,
    pub out: DeviceRows,
}

/// One expert of a group's backward in one call
/// ([`ExpertDevice::experts_backward_rows`]): its params, its forward's
/// input rows `x`, its output gradient `dout` and its input gradient `dx`
/// (overwritten), (n, D) each in the device's memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertBackwardRows {
    pub params: SlotParams,
    pub x: DeviceRows,
    pub dout: DeviceRows,
    pub dx: DeviceRows,
}

/// An expert's weight gradient that a device's backward left in its memory
/// ([`ExpertDevice::expert_backward_rows`]). Dropped untaken (a step that
/// failed), it is freed with nothing copied.
pub trait DeviceGradient: Send {
    /// Copies the gradient into `dparams` (the expert's params' count of
    /// f32) in host memory, once the backward that makes it has run.
    fn take(self: Box<Self>, dparams: &mut [f32]) -> Result<(), EngineError>;

    /// Queues the gradient's copy into a page-locked buffer of the
    /// device's own and returns at once, the copy in flight: whoever reads
    /// the gradient waits for it ([`ArrivingGradient::wait`]), so that the
    /// CPU AdamW starts when the copy ends and no engine thread waits for
    /// it. Where every such buffer is still in use, the gradient comes
    /// back unmoved, to [`Self::take`].
    fn start_download(self: Box<Self>) -> Result<Download, EngineError>;
}

/// What [`DeviceGradient::start_download`] did.
pub enum Download {
    /// The copy is queued.
    Started(Box<dyn ArrivingGradient>),
    /// No page-locked buffer was free: nothing was queued.
    NoBuffer(Box<dyn DeviceGradient>),
}

/// Page-locked gradient buffers a GPU keeps for
/// [`DeviceGradient::start_download`]: one for the copy in flight, two for
/// updates still reading theirs. Each holds an expert's gradient in f32;
/// the host memory plan counts them.
pub const GRADIENT_DOWNLOAD_BUFFERS: usize = 3;

/// An expert's gradient on its way to host memory
/// ([`DeviceGradient::start_download`]). Dropped, its buffer goes back to
/// the device, whose next copy into it waits for this one.
pub trait ArrivingGradient: Send {
    /// Waits until the copy has ended (a bounded wait: the GPU either
    /// completes it or reports its failure); returns at once once it has.
    fn wait(&mut self) -> Result<(), EngineError>;

    /// The gradient (the expert's params' count of f32). Panics unless
    /// [`Self::wait`] has returned `Ok`.
    fn values(&self) -> &[f32];
}

/// [`ExpertDevice::experts_forward_rows`] one expert at a time.
///
/// # Safety
/// As [`ExpertDevice::experts_forward_rows`].
pub(crate) unsafe fn forward_each<D: ExpertDevice + ?Sized>(
    device: &mut D,
    kind: ExpertKind,
    group: &[ExpertForwardRows],
    (d, f): (usize, usize),
) -> Result<(), EngineError> {
    for e in group {
        let n = e.x.len / d;
        // SAFETY: the caller's contract, for this expert's rows.
        unsafe { device.expert_forward_rows(kind, e.out, e.x, e.params, n, d, f)? };
    }
    Ok(())
}

/// [`ExpertDevice::experts_backward_rows`] one expert at a time.
///
/// # Safety
/// As [`ExpertDevice::experts_backward_rows`].
pub(crate) unsafe fn backward_each<D: ExpertDevice + ?Sized>(
    device: &mut D,
    kind: ExpertKind,
    group: &[ExpertBackwardRows],
    (d, f): (usize, usize),
) -> Result<Vec<Box<dyn DeviceGradient>>, EngineError> {
    let mut grads = Vec::with_capacity(group.len());
    for e in group {
        let n = e.x.len / d;
        // SAFETY: the caller's contract, for this expert's rows.
        grads.push(unsafe {
            device.expert_backward_rows(kind, e.dx, e.dout, e.x, e.params, n, d, f)?
        });
    }
    Ok(grads)
}

/// The error of a device asked to compute from rows in its memory that
/// takes host rows only.
fn host_rows_only(device: &str) -> EngineError {
    EngineError::Device {
        device: 0,
        why: format!("the {device} device computes experts from host rows only"),
    }
}

/// One compute device: its expert slots and the expert FFN on them. The
/// engine uploads an expert into a slot through [`ExpertDevice::arena`],
/// waits for the copy's event (unless the device orders its reads after
/// the upload itself: [`ExpertDevice::orders_uploads`]), then computes
/// from the slot. A call may return before its work is done on a device
/// that queues it (a GPU); the slot may still be refilled at once, since
/// such a device also orders the next upload into a slot after its reads,
/// and [`ExpertDevice::finish_pass`] waits for all of it.
pub trait ExpertDevice: Send {
    fn name(&self) -> &'static str;

    /// This device's tier of expert slots.
    fn arena(&self) -> &dyn DeviceArena;

    /// Page-locks the host tier's region, which this device's uploads read
    /// (a GPU registers it with its driver, for every GPU at once). Returns
    /// why not when refused; then every device is told to
    /// [`ExpertDevice::stage_uploads`]. The cpu device has nothing to do.
    /// The device keeps the region's memory mapped while it holds it.
    fn page_lock_host_region(&mut self, region: &HostRegion) -> Option<String> {
        let _ = region;
        None
    }

    /// The dense layers' GEMMs on this device (the cpu's, or cuBLAS f32
    /// GEMMs on the same GPU, stream and handle as the experts'); the
    /// engine holds it beside the device, which passes borrow mutably.
    fn dense_kernels(&self) -> Arc<dyn DenseKernels + Send + Sync>;

    /// Uploads from host memory that is not page-locked: a GPU stages them
    /// through page-locked buffers of its own so they stay asynchronous.
    /// The cpu device has nothing to do.
    fn stage_uploads(&mut self) -> Result<(), EngineError> {
        Ok(())
    }

    /// Whether `expert_backward` recomputes from x whatever its forward
    /// would keep in `saved` (a GPU does), so the engine's
    /// `recompute_hidden` needs no forward of its own before it.
    fn backward_recomputes(&self) -> bool {
        false
    }

    /// Whether the device itself orders its reads of a slot after the
    /// slot's upload (a GPU's compute stream waits for the upload's event
    /// on the device), so that the engine starts an expert's compute
    /// without waiting on the host for its upload. The cpu device reads
    /// its slots on the host, and needs the wait.
    fn orders_uploads(&self) -> bool {
        false
    }

    /// Waits until the expert work queued so far has run, and reports its
    /// failure: the engine calls it at the end of each layer's pass over
    /// its experts. A device whose calls return with their work done (the
    /// cpu) has nothing to wait for.
    fn finish_pass(&mut self) -> Result<(), EngineError> {
        Ok(())
    }

    /// Whether the time of its expert calls is compute time, which the
    /// step's metrics report and placement calibrates on. A device that
    /// skips the GEMMs (`ExpertCompute::Skip`) computes nothing.
    fn computes(&self) -> bool {
        true
    }

    /// out (n, D) = expert(x (n, D)) with the params in `params`' slot;
    /// `saved` keeps what this device's backward needs (see
    /// [`CpuBackend::expert_ffn_forward`](crate::backend::CpuBackend::expert_ffn_forward)).
    #[allow(clippy::too_many_arguments)]
    fn expert_forward(
        &mut self,
        kind: ExpertKind,
        out: &mut [f32],
        saved: &mut ExpertSaved<f32>,
        x: &[f32],
        params: SlotParams,
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError>;

    /// Whether this device computes experts from rows in its own memory
    /// ([`Self::expert_forward_rows`]): a GPU does.
    fn takes_device_rows(&self) -> bool {
        false
    }

    /// [`Self::expert_forward`] on rows in this device's memory: `out`
    /// and `x` (n, D) each. Returns with the slot no longer read.
    ///
    /// # Safety
    /// `out` and `x` address n·D f32 of this device's memory each, alive
    /// until the call returns and not used by anything else meanwhile.
    #[allow(clippy::too_many_arguments)]
    unsafe fn expert_forward_rows(
        &mut self,
        kind: ExpertKind,
        out: DeviceRows,
        x: DeviceRows,
        params: SlotParams,
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        let _ = (kind, out, x, params, n, d, f);
        Err(host_rows_only(self.name()))
    }

    /// [`Self::expert_backward`] on rows in this device's memory: `dx`
    /// (overwritten), `dout` and `x` (n, D) each, queued on the device. The
    /// expert's gradient stays there until [`DeviceGradient::take`] brings
    /// it to host memory, which waits for this backward alone: so the
    /// engine queues the next expert's backward before it takes this one's
    /// gradient, and the device computes while the gradient comes down.
    ///
    /// # Safety
    /// As [`Self::expert_forward_rows`], for the three rows.
    #[allow(clippy::too_many_arguments)]
    unsafe fn expert_backward_rows(
        &mut self,
        kind: ExpertKind,
        dx: DeviceRows,
        dout: DeviceRows,
        x: DeviceRows,
        params: SlotParams,
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<Box<dyn DeviceGradient>, EngineError> {
        let _ = (kind, dx, dout, x, params, n, d, f);
        Err(host_rows_only(self.name()))
    }

    /// [`Self::expert_forward`] for each expert of `group`, side by side
    /// where the device can (the default: one after another). The results
    /// are each expert's alone, the same bits as one at a time.
    fn experts_forward(
        &mut self,
        kind: ExpertKind,
        group: &mut [ExpertForward],
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        for e in group {
            let n = e.x.len() / d;
            self.expert_forward(kind, e.out, e.saved, e.x, e.params, n, d, f)?;
        }
        Ok(())
    }

    /// [`Self::expert_backward`] for each expert of `group`, side by side
    /// where the device can (the default: one after another), the same
    /// bits as one at a time.
    fn experts_backward(
        &mut self,
        kind: ExpertKind,
        group: &mut [ExpertBackward],
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        for e in group {
            let n = e.x.len() / d;
            self.expert_backward(
                kind, e.dx, e.dparams, e.dout, e.saved, e.x, e.params, n, d, f,
            )?;
        }
        Ok(())
    }

    /// The most experts this device computes in one call
    /// ([`Self::experts_forward_rows`], [`Self::experts_backward_rows`] on
    /// a GPU; [`Self::experts_forward`], [`Self::experts_backward`] on
    /// host rows): 1, the default, computes them one at a time; a GPU runs
    /// each of a group's products as one grouped GEMM, the cpu its experts
    /// side by side on the compute threads.
    fn group_limit(&self) -> usize {
        1
    }

    /// [`Self::expert_forward_rows`] for each expert of `group`, in one
    /// call where the device can (the default: one after another). The
    /// results are each expert's alone, the same bits as one at a time.
    ///
    /// # Safety
    /// As [`Self::expert_forward_rows`], for every expert's rows.
    unsafe fn experts_forward_rows(
        &mut self,
        kind: ExpertKind,
        group: &[ExpertForwardRows],
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        // SAFETY: the caller's contract.
        unsafe { forward_each(self, kind, group, (d, f)) }
    }

    /// [`Self::expert_backward_rows`] for each expert of `group`, in one
    /// call where the device can (the default: one after another): each
    /// expert's gradient, in `group`'s order.
    ///
    /// # Safety
    /// As [`Self::expert_backward_rows`], for every expert's rows.
    unsafe fn experts_backward_rows(
        &mut self,
        kind: ExpertKind,
        group: &[ExpertBackwardRows],
        d: usize,
        f: usize,
    ) -> Result<Vec<Box<dyn DeviceGradient>>, EngineError> {
        // SAFETY: the caller's contract.
        unsafe { backward_each(self, kind, group, (d, f)) }
    }

    /// dx (n, D) = …, dparams (`params.count` f32) = the expert's
    /// gradient. Both are overwritten: what they held is never read, so
    /// the engine hands in its kept gradient buffers as they are. (The cpu
    /// device's GEMMs write the gradient without reading it; a GPU device
    /// starts it from zero on the device, which for a Mixtral-sized expert
    /// saves uploading 704 MB of zeros a backward.)
    #[allow(clippy::too_many_arguments)]
    fn expert_backward(
        &mut self,
        kind: ExpertKind,
        dx: &mut [f32],
        dparams: &mut [f32],
        dout: &[f32],
        saved: &ExpertSaved<f32>,
        x: &[f32],
        params: SlotParams,
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError>;
}

#[cfg(test)]
mod tests {
    use super::DeviceRows;

    #[test]
    fn a_block_of_rows_starts_at_its_first_row_s_address() {
        let rows = DeviceRows::new(0x1000, 6 * 4); // 6 rows of 4 f32
        let block = rows.rows(2..5, 4);
        assert_eq!(block, DeviceRows::new(0x1000 + 2 * 4 * 4, 3 * 4));
        assert_eq!(rows.rows(6..6, 4).len, 0);
    }

    #[test]
    #[should_panic(expected = "rows beyond the buffer")]
    fn rows_beyond_the_buffer_are_refused() {
        DeviceRows::new(0x1000, 6 * 4).rows(4..7, 4);
    }
}
