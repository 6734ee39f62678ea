//! A language model's head and loss on the GPU, a block of rows at a
//! time ([`DenseKernels::head_loss`](crate::model::DenseKernels::head_loss)):
//! the block's logits are computed, turned into their loss and d logits
//! and taken back through the head without leaving the device. Only the
//! head's input rows and targets go up, and d input and one loss share a
//! row come down; the head's gradient sums in the step's GPU accumulator
//! (`weights.rs`). A block holds at most [`HEAD_BLOCK_BYTES`] of logits
//! (and as much of d logits), so a large vocabulary's (T × V) logits never
//! exist whole.

use super::{CudaBackend, Shape};
use crate::model::HeadShape;
use crate::EngineError;

/// The logits of one block of rows, at most (in bytes; one row at least).
pub const HEAD_BLOCK_BYTES: usize = 1 << 30;

/// Rows a block holds for a vocabulary of `v`.
pub fn head_block_rows(v: usize) -> usize {
    (HEAD_BLOCK_BYTES / (4 * v)).max(1)
}

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
        let HeadShape { t, d, v, .. } = s;
        assert!(block > 0, "a block holds a row at least");
        assert!(dx.len() == t * d && x.len() == t * d && targets.len() == t);
        assert!(dhead.len() == v * d && head.len() == v * d);
        self.bind()?;
        let w = self.weight(head)?;
        // The head's gradient: the step's accumulator for its slice of the
        // dense gradient, else a buffer of its own added in at the end.
        let mut grads = self.grads.lock().unwrap_or_else(|p| p.into_inner());
        let mut own = None;
        let acc = match grads.accumulator(dhead, |len| self.zeros(len))? {
            Some(acc) => acc,
            None => own.insert(self.upload(dhead)?),
        };
        let mut loss = 0.0f32;
        let mut shares = Vec::with_capacity(block.min(t));
        for start in (0..t).step_by(block) {
            let n = block.min(t - start);
            let rows = start * d..(start + n) * d;
            let xb = self.upload(&x[rows.clone()])?;
            let tb = self.upload_u32(&targets[start..start + n])?;
            let mut logits = self.zeros(n * v)?;
            self.linear_forward_f32(&mut logits, &xb, &w, Shape { m: n, k: d, n: v })?;
            let mut dlogits = self.zeros(n * v)?;
            let row_loss = self.cross_entropy_rows(&logits, &tb, &mut dlogits, v, s.denominator)?;
            drop(logits);
            let mut dxb = self.zeros(n * d)?; // dx is overwritten
            let shape = Shape { m: n, k: d, n: v };
            self.linear_backward_f32(&mut dxb, acc, &dlogits, &xb, &w, shape)?;
            self.download(&dxb, &mut dx[rows])?;
            shares.resize(n, 0.0);
            self.download(&row_loss, &mut shares)?;
            // Row order, as the host sums the kernel's shares.
            loss = shares.iter().fold(loss, |a, &r| a + r);
        }
        if let Some(own) = own {
            self.download(&own, dhead)?;
        }
        Ok(loss)
    }
}
