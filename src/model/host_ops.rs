//! [`HostOps`]: the dense layers' operations ([`DenseOps`]) on
//! activations in host memory, each as `math` writes it, the GEMMs and
//! attention through the backend's [`DenseKernels`].

#![allow(clippy::too_many_arguments)]

use std::borrow::Cow;

use super::{moe_backward, moe_forward, DenseKernels, DenseOps, ExpertRunner, HeadShape};
use super::{ModelConfig, MoeSaved, TokenIds, TokenRows};
use crate::math::attention::{
    embedding_backward, embedding_forward, rope_backward, rope_forward, AttnShape, RopeTable,
};
use crate::math::{
    add_prob_sums, cross_entropy_loss_after, rmsnorm_backward, rmsnorm_forward, sigmoid, silu,
    silu_grad,
};
use crate::EngineError;

/// Activations in host memory, each operation as `math` writes it, the
/// GEMMs and attention through `kernels`: the cpu's dense layers.
pub struct HostOps<'k> {
    kernels: &'k dyn DenseKernels,
}

impl<'k> HostOps<'k> {
    pub fn new(kernels: &'k dyn DenseKernels) -> Self {
        Self { kernels }
    }
}

impl DenseOps for HostOps<'_> {
    type Buf = Vec<f32>;

    fn kernels(&self) -> &dyn DenseKernels {
        self.kernels
    }

    fn zeros(&self, n: usize) -> Result<Vec<f32>, EngineError> {
        Ok(vec![0.0; n])
    }

    fn len(&self, x: &Vec<f32>) -> usize {
        x.len()
    }

    fn duplicate(&self, x: &Vec<f32>) -> Result<Vec<f32>, EngineError> {
        Ok(x.clone())
    }

    fn place(&self, x: Vec<f32>) -> Result<Vec<f32>, EngineError> {
        Ok(x)
    }

    fn read<'a>(&self, x: &'a Vec<f32>) -> Result<Cow<'a, [f32]>, EngineError> {
        Ok(Cow::Borrowed(x))
    }

    fn take(&self, x: Vec<f32>) -> Result<Vec<f32>, EngineError> {
        Ok(x)
    }

    fn add_assign(&self, acc: &mut Vec<f32>, x: &Vec<f32>) -> Result<(), EngineError> {
        assert_eq!(acc.len(), x.len());
        acc.iter_mut().zip(x).for_each(|(a, b)| *a += b);
        Ok(())
    }

    fn add_bias(&self, x: &mut Vec<f32>, b: &[f32]) -> Result<(), EngineError> {
        for row in x.chunks_exact_mut(b.len()) {
            row.iter_mut().zip(b).for_each(|(x, b)| *x += b);
        }
        Ok(())
    }

    fn bias_grad(&self, db: &mut [f32], dx: &Vec<f32>) -> Result<(), EngineError> {
        for row in dx.chunks_exact(db.len()) {
            db.iter_mut().zip(row).for_each(|(d, g)| *d += g);
        }
        Ok(())
    }

    fn clamp(&self, x: &mut Vec<f32>, clip: f32) -> Result<(), EngineError> {
        x.iter_mut().for_each(|x| *x = x.clamp(-clip, clip));
        Ok(())
    }

    fn clamp_grad(
        &self,
        grad: &mut Vec<f32>,
        before: &Vec<f32>,
        clip: f32,
    ) -> Result<(), EngineError> {
        for (g, &x) in grad.iter_mut().zip(before) {
            if !(-clip..=clip).contains(&x) {
                *g = 0.0;
            }
        }
        Ok(())
    }

    fn swiglu(&self, a: &Vec<f32>, b: &Vec<f32>) -> Result<Vec<f32>, EngineError> {
        Ok(a.iter().zip(b).map(|(&a, &b)| silu(a) * b).collect())
    }

    fn swiglu_backward(
        &self,
        dh: &Vec<f32>,
        a: &Vec<f32>,
        b: &Vec<f32>,
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        let da = (0..dh.len()).map(|i| dh[i] * b[i] * silu_grad(a[i]));
        let db = (0..dh.len()).map(|i| dh[i] * silu(a[i]));
        Ok((da.collect(), db.collect()))
    }

    fn sigmoid(&self, x: &mut Vec<f32>) -> Result<(), EngineError> {
        x.iter_mut().for_each(|v| *v = sigmoid(*v));
        Ok(())
    }

    fn add_scaled_rows(
        &self,
        y: &mut Vec<f32>,
        x: &Vec<f32>,
        s: &Vec<f32>,
    ) -> Result<(), EngineError> {
        let d = y.len() / s.len();
        for ((y, x), &s) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)).zip(s) {
            y.iter_mut().zip(x).for_each(|(y, x)| *y += s * x);
        }
        Ok(())
    }

    fn gate_backward(
        &self,
        dy: &Vec<f32>,
        out: &Vec<f32>,
        sig: &Vec<f32>,
    ) -> Result<(Vec<f32>, Vec<f32>), EngineError> {
        let d = dy.len() / sig.len();
        let mut dz = vec![0.0f32; sig.len()];
        let mut dout = vec![0.0f32; dy.len()];
        let rows = dy.chunks_exact(d).zip(out.chunks_exact(d));
        for (i, ((dyi, oi), dout)) in rows.zip(dout.chunks_exact_mut(d)).enumerate() {
            let dot: f32 = dyi.iter().zip(oi).map(|(g, o)| g * o).sum();
            let s = sig[i];
            dz[i] = s * (1.0 - s) * dot;
            dout.iter_mut().zip(dyi).for_each(|(o, g)| *o = s * g);
        }
        Ok((dz, dout))
    }

    fn rmsnorm_forward(
        &self,
        out: &mut Vec<f32>,
        inv_rms: &mut Vec<f32>,
        x: &Vec<f32>,
        g: &[f32],
        rows: usize,
        width: usize,
        eps: f64,
    ) -> Result<(), EngineError> {
        rmsnorm_forward(out, inv_rms, x, g, rows, width, eps);
        Ok(())
    }

    fn rmsnorm_backward(
        &self,
        dx: &mut Vec<f32>,
        dg: &mut [f32],
        dout: &Vec<f32>,
        x: &Vec<f32>,
        g: &[f32],
        inv_rms: &Vec<f32>,
        rows: usize,
        width: usize,
    ) -> Result<(), EngineError> {
        rmsnorm_backward(dx, dg, dout, x, g, inv_rms, rows, width);
        Ok(())
    }

    fn linear_forward(
        &self,
        out: &mut Vec<f32>,
        x: &Vec<f32>,
        w: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), EngineError> {
        self.kernels.forward(out, x, w, m, k, n)
    }

    fn linear_backward(
        &self,
        dx: &mut Vec<f32>,
        dw: &mut [f32],
        dout: &Vec<f32>,
        x: &Vec<f32>,
        w: &[f32],
        m: usize,
        k: usize,
        n: usize,
    ) -> Result<(), EngineError> {
        self.kernels.backward(dx, dw, dout, x, w, m, k, n)
    }

    fn rope(
        &self,
        x: &mut Vec<f32>,
        table: &RopeTable<f32>,
        seq_len: usize,
        heads: usize,
        transpose: bool,
    ) -> Result<(), EngineError> {
        if transpose {
            rope_backward(x, table, seq_len, heads);
        } else {
            rope_forward(x, table, seq_len, heads);
        }
        Ok(())
    }

    type DeviceIds = ();

    fn token_ids(&self, rows: TokenRows<'_>) -> Result<TokenIds<()>, EngineError> {
        let (inputs, targets) = rows.inputs_targets();
        Ok(TokenIds {
            inputs,
            targets,
            device: (),
        })
    }

    fn embedding_forward(
        &self,
        table: &[f32],
        ids: &TokenIds<()>,
        d: usize,
    ) -> Result<Vec<f32>, EngineError> {
        let mut h = vec![0.0f32; ids.inputs.len() * d];
        embedding_forward(&mut h, table, &ids.inputs, d);
        Ok(h)
    }

    fn embedding_backward(
        &self,
        dtable: &mut [f32],
        dh: &Vec<f32>,
        ids: &TokenIds<()>,
        d: usize,
    ) -> Result<(), EngineError> {
        embedding_backward(dtable, dh, &ids.inputs, d);
        Ok(())
    }

    fn head_loss(
        &self,
        dx: &mut Vec<f32>,
        dhead: &mut [f32],
        x: &Vec<f32>,
        head: &[f32],
        ids: &TokenIds<()>,
        s: HeadShape,
    ) -> Result<f32, EngineError> {
        self.kernels.head_loss(dx, dhead, x, head, &ids.targets, s)
    }

    fn head_loss_forward(
        &self,
        x: &Vec<f32>,
        head: &[f32],
        ids: &TokenIds<()>,
        s: HeadShape,
    ) -> Result<f32, EngineError> {
        let block = crate::backend::head_block_rows(s.v);
        head_loss_forward_in_blocks(self.kernels, x, head, &ids.targets, s, block)
    }

    type MoeSaved = MoeSaved;

    fn moe_forward(
        &self,
        model: &ModelConfig,
        layer: usize,
        (router, bias): (&[f32], Option<&[f32]>),
        x: &Vec<f32>,
        t: usize,
        runner: &mut dyn ExpertRunner,
    ) -> Result<(Vec<f32>, MoeSaved), EngineError> {
        moe_forward(model, layer, router, bias, x, t, runner, self.kernels)
    }

    fn moe_backward(
        &self,
        model: &ModelConfig,
        layer: usize,
        (router, router_grad): (&[f32], &mut [f32]),
        (dx, dy, x): (&mut Vec<f32>, &Vec<f32>, &Vec<f32>),
        saved: &MoeSaved,
        (daux, dz): (f32, f32),
        runner: &mut dyn ExpertRunner,
        last_micro_batch: bool,
    ) -> Result<(), EngineError> {
        let t = dy.len() / model.d_model.max(1);
        moe_backward(
            model,
            layer,
            router,
            router_grad,
            dx,
            dy,
            x,
            saved,
            t,
            daux,
            dz,
            runner,
            last_micro_batch,
            self.kernels,
        )
    }

    fn moe_prob_sums(&self, saved: &[&MoeSaved], experts: usize) -> Result<Vec<f64>, EngineError> {
        let mut sums = vec![0.0f64; experts];
        for block in saved {
            add_prob_sums(&block.routing.probs, &mut sums);
        }
        Ok(sums)
    }

    fn moe_release(&self, saved: &mut MoeSaved, runner: &mut dyn ExpertRunner) {
        runner.give_buffer(std::mem::take(&mut saved.expert_out));
    }

    fn moe_output_done(&self, y: Vec<f32>, runner: &mut dyn ExpertRunner) {
        runner.give_buffer(y);
    }

    fn on_host<R>(
        &self,
        x: &mut Vec<f32>,
        f: impl FnOnce(&mut [f32]) -> Result<R, EngineError>,
    ) -> Result<R, EngineError> {
        f(x)
    }

    fn attention_saved_len(&self, shape: &AttnShape) -> usize {
        self.kernels.attention_saved_len(shape)
    }

    fn attention_forward(
        &self,
        out: &mut Vec<f32>,
        saved: &mut Vec<f32>,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        starts: Option<&[u32]>,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        self.kernels
            .attention_forward(out, saved, q, k, v, starts, shape)
    }

    fn attention_backward(
        &self,
        [dq, dk, dv]: [&mut Vec<f32>; 3],
        dout: &Vec<f32>,
        saved: &Vec<f32>,
        [q, k, v]: [&Vec<f32>; 3],
        starts: Option<&[u32]>,
        shape: &AttnShape,
    ) -> Result<(), EngineError> {
        self.kernels
            .attention_backward(dq, dk, dv, dout, saved, q, k, v, starts, shape)
    }
}

/// [`DenseOps::head_loss_forward`] on host buffers in blocks of `block`
/// rows: each block's logits from `kernels`, their cross-entropy added
/// row after row onto the blocks' before (`math::cross_entropy_loss_after`),
/// so the loss is the whole's wherever a row's logits do not depend on
/// the rows beside it.
pub fn head_loss_forward_in_blocks(
    kernels: &dyn DenseKernels,
    x: &[f32],
    head: &[f32],
    targets: &[u32],
    s: HeadShape,
    block: usize,
) -> Result<f32, EngineError> {
    let HeadShape {
        t,
        d,
        v,
        denominator,
    } = s;
    assert!(block > 0 && x.len() == t * d && targets.len() == t && head.len() == v * d);
    let mut logits = vec![0.0f32; block.min(t) * v];
    let mut loss = 0.0f32;
    for start in (0..t).step_by(block) {
        let n = block.min(t - start);
        let rows = &x[start * d..(start + n) * d];
        kernels.forward(&mut logits[..n * v], rows, head, n, d, v)?;
        let targets = &targets[start..start + n];
        loss = cross_entropy_loss_after(loss, &logits[..n * v], targets, v, denominator);
    }
    Ok(loss)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::math::{cross_entropy_loss, IGNORED_TARGET};
    use crate::model::PlainKernels;

    /// Blocks of rows, each continuing the last's sum, give the loss of
    /// every row's logits at once, to the bit; a row without loss adds
    /// nothing.
    #[test]
    fn the_head_s_loss_in_blocks_is_the_whole_s() {
        let (t, d, v) = (10, 6, 7);
        let value = |i: usize, scale: f32| ((i * 37 % 23) as f32 / 11.0 - 1.0) * scale;
        let x: Vec<f32> = (0..t * d).map(|i| value(i, 1.0)).collect();
        let head: Vec<f32> = (0..v * d).map(|i| value(i + 5, 0.7)).collect();
        let mut targets: Vec<u32> = (0..t as u32).map(|i| i * 3 % v as u32).collect();
        targets[4] = IGNORED_TARGET;
        let s = HeadShape {
            t,
            d,
            v,
            denominator: 9,
        };
        let mut logits = vec![0.0f32; t * v];
        PlainKernels
            .forward(&mut logits, &x, &head, t, d, v)
            .unwrap();
        let whole = cross_entropy_loss(&logits, &targets, v, 9);
        for block in [1, 3, 10, 64] {
            let got = head_loss_forward_in_blocks(&PlainKernels, &x, &head, &targets, s, block);
            assert_eq!(got.unwrap().to_bits(), whole.to_bits(), "blocks of {block}");
        }
    }
}
