//! A language model's head and loss on the GPU, a block of rows at a
//! time (its GEMMs taking the backend's [`DenseGemm`](crate::backend::DenseGemm) inputs) ([`DenseKernels::head_loss`](crate::model::DenseKernels::head_loss)):
//! the block's logits are computed, turned into their loss and d logits
//! and taken back through the head without leaving the device, and the
//! rows' loss shares are added there in row order: only the loss comes
//! down. The head's gradient sums in the step's GPU accumulator
//! (`weights.rs`). A block holds at most [`HEAD_BLOCK_BYTES`](crate::backend::HEAD_BLOCK_BYTES) of logits
//! (and as much of d logits), so a large vocabulary's (T × V) logits never
//! exist whole.

use cudarc::driver::{CudaSlice, DevicePtrMut};

use super::gemm::{blas_type, input_bytes};
use super::{CudaBackend, Shape};
use crate::model::HeadShape;
use crate::EngineError;

impl CudaBackend {
    /// `head_loss` in blocks of `block` rows (the engine's are
    /// `head_block_rows`; tests choose blocks that split a small batch).
    #[allow(clippy::too_many_arguments)]
    pub fn head_loss_in_blocks(
        &self,
        dx: &mut [f32],
        dhead: &mut [f32],
        x: &[f32],
        head: &[f32],
        targets: &[u32],
        s: HeadShape,
        block: usize,
    ) -> Result<f32, EngineError> {
        let HeadShape { t, d, .. } = s;
        assert!(dx.len() == t * d && x.len() == t * d);
        self.bind()?;
        let (xd, targets) = (self.upload(x)?, self.upload_u32(targets)?);
        let mut dxd = self.zeros(t * d)?;
        let loss = self.head_loss_device(&mut dxd, dhead, &xd, head, &targets, s, block)?;
        self.download(&dxd, dx)?;
        Ok(loss)
    }

    /// `head_loss` with x and dx (T, D; dx overwritten) and the targets in
    /// GPU memory, in blocks of `block` rows.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn head_loss_device(
        &self,
        dx: &mut CudaSlice<f32>,
        dhead: &mut [f32],
        x: &CudaSlice<f32>,
        head: &[f32],
        targets: &CudaSlice<u32>,
        s: HeadShape,
        block: usize,
    ) -> Result<f32, EngineError> {
        let HeadShape { t, d, v, .. } = s;
        assert!(block > 0, "a block holds a row at least");
        assert!(dx.len() == t * d && x.len() == t * d && targets.len() == t);
        assert!(dhead.len() == v * d && head.len() == v * d);
        let gemm = self.dense_gemm;
        let (w, xg) = (self.gemm_weight(gemm, head)?, self.gemm_rows(gemm, x)?);
        self.memset_zeros(dx)?; // overwritten: the blocks' backward adds to it
        let (w_ptr, _rw) = w.device_ptr(&self.stream);
        let (x_ptr, _rx) = xg.device_ptr(&self.stream);
        let (dx_ptr, _wdx) = dx.device_ptr_mut(&self.stream);
        // The head's gradient: the step's accumulator for its slice of the
        // dense gradient, else a copy of its own downloaded at the end.
        let mut shares = self.zeros(t)?;
        self.with_grad(dhead, |acc| {
            let (acc_ptr, _wacc) = acc.device_ptr_mut(&self.stream);
            let row_bytes = (d * std::mem::size_of::<f32>()) as u64;
            let input_row_bytes = (d * input_bytes(gemm)) as u64;
            for start in (0..t).step_by(block) {
                let n = block.min(t - start);
                let (xb, dxb) = (
                    x_ptr + start as u64 * input_row_bytes,
                    dx_ptr + start as u64 * row_bytes,
                );
                let shape = Shape { m: n, k: d, n: v };
                // SAFETY: x's block holds n·d values of the GEMM's type
                // from row `start` (< t), the head v·d; both alive past
                // the call.
                let logits = unsafe { self.block_logits(xb, w_ptr, shape)? };
                let mut dlogits = self.zeros(n * v)?;
                let (tb, rows) = (
                    &targets.slice(start..start + n),
                    &mut shares.slice_mut(start..start + n),
                );
                self.cross_entropy_rows(&logits, tb, Some(&mut dlogits), rows, v, s.denominator)?;
                drop(logits);
                {
                    let dlogits = self.gemm_rows(gemm, &dlogits)?;
                    let (dl_ptr, _rdl) = dlogits.device_ptr(&self.stream);
                    // SAFETY: dx's block holds n·d f32, x's n·d values of
                    // the GEMM's type, the accumulator v·d f32, d logits
                    // n·v of the GEMM's type; all alive past the call.
                    unsafe {
                        self.linear_backward_at(
                            [dxb, acc_ptr],
                            [dl_ptr, xb],
                            w_ptr,
                            shape,
                            blas_type(gemm),
                        )?
                    };
                }
            }
            Ok(())
        })?;
        self.sum_in_order(&shares)
    }

    /// The head's cross-entropy of x (T, D, in GPU memory) against the
    /// targets, forward only (evaluation), in blocks of `block` rows: the
    /// rows' loss shares summed in row order on the GPU.
    pub(super) fn head_loss_forward_device(
        &self,
        x: &CudaSlice<f32>,
        head: &[f32],
        targets: &CudaSlice<u32>,
        s: HeadShape,
        block: usize,
    ) -> Result<f32, EngineError> {
        let HeadShape { t, d, v, .. } = s;
        assert!(block > 0 && x.len() == t * d && targets.len() == t && head.len() == v * d);
        let gemm = self.dense_gemm;
        let (w, xg) = (self.gemm_weight(gemm, head)?, self.gemm_rows(gemm, x)?);
        let (w_ptr, _rw) = w.device_ptr(&self.stream);
        let (x_ptr, _rx) = xg.device_ptr(&self.stream);
        let mut shares = self.zeros(t)?;
        let input_row_bytes = (d * input_bytes(gemm)) as u64;
        for start in (0..t).step_by(block) {
            let n = block.min(t - start);
            let shape = Shape { m: n, k: d, n: v };
            let xb = x_ptr + start as u64 * input_row_bytes;
            // SAFETY: x's block holds n·d values of the GEMM's type from
            // row `start` (< t), the head v·d; both alive past the call.
            let logits = unsafe { self.block_logits(xb, w_ptr, shape)? };
            let (tb, rows) = (
                &targets.slice(start..start + n),
                &mut shares.slice_mut(start..start + n),
            );
            self.cross_entropy_rows(&logits, tb, None, rows, v, s.denominator)?;
        }
        self.sum_in_order(&shares)
    }

    /// `head_loss_forward_device` on host slices, for the tests.
    pub fn head_loss_forward_in_blocks(
        &self,
        x: &[f32],
        head: &[f32],
        targets: &[u32],
        s: HeadShape,
        block: usize,
    ) -> Result<f32, EngineError> {
        self.bind()?;
        let (xd, targets) = (self.upload(x)?, self.upload_u32(targets)?);
        self.head_loss_forward_device(&xd, head, &targets, s, block)
    }

    /// A block's logits (m × v, f32) from its input rows at `x` and the
    /// head at `w`, both of the dense GEMMs' type.
    ///
    /// # Safety
    /// `x` addresses m·k values and `w` v·k of that type in this context's
    /// memory, alive and unwritten until the GEMM queued here has run.
    unsafe fn block_logits(
        &self,
        x: cudarc::driver::sys::CUdeviceptr,
        w: cudarc::driver::sys::CUdeviceptr,
        shape: Shape,
    ) -> Result<CudaSlice<f32>, EngineError> {
        let mut logits = self.zeros(shape.m * shape.n)?;
        {
            let (logits_ptr, _written) = logits.device_ptr_mut(&self.stream);
            // SAFETY: logits holds m·n f32; x and w as the caller promises.
            unsafe { self.linear_forward_at(logits_ptr, x, w, shape, blas_type(self.dense_gemm))? };
        }
        Ok(logits)
    }
}
