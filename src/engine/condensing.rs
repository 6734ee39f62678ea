//! Token condensation in a step ([`crate::condense`]): a runner in front of
//! a device's own ([`super::pipeline::DeviceRunner`], or with several
//! devices the [`super::exchange::ExchangeRunner`], so that what is
//! condensed is what one device sends to one expert).
//!
//! A layer's representatives become the tokens of a smaller layer that the
//! runner behind sees as any other: representative j is token j, routed
//! to its expert alone (assignment j · K, the slot the gathers read), with
//! its input row. Its output comes back to every member of its group; in
//! the backward, token j's output gradient is the sum of its members'
//! (each its combine weight times the output's gradient, the
//! representative's first, then the members' in order) and its input
//! gradient goes to the representative's row alone. A layer where nothing
//! is condensed is handed on as it is, so a threshold that groups nothing
//! gives exact training's bits.

use crate::condense::{condense_rows, inverse_norms, SignatureTables};
use crate::math::{gather_forward, AssignmentGrads, Permutation};
use crate::model::{ExpertRunner, ModelConfig};
use crate::EngineError;

/// Runs `pass` (a micro-batch's forward and backward) on `runner`, in
/// front of which a [`Condensing`] stands where `step` says the step
/// condenses; returns what `pass` did and the assignments condensed.
pub(crate) fn condensed_pass<T>(
    runner: &mut dyn ExpertRunner,
    step: Option<StepCondense<'_>>,
    model: &ModelConfig,
    pass: impl FnOnce(&mut dyn ExpertRunner) -> Result<T, EngineError>,
) -> Result<(T, u64), EngineError> {
    let Some(step) = step else {
        return pass(runner).map(|t| (t, 0));
    };
    let mut condensing = Condensing::new(runner, step, model);
    let t = pass(&mut condensing)?;
    Ok((t, condensing.condensed))
}

/// The condensation of a step, as the engine decided it.
#[derive(Clone, Copy)]
pub(crate) struct StepCondense<'a> {
    pub threshold: f32,
    pub max_share: f32,
    /// `None`: the exact search.
    pub signatures: Option<&'a SignatureTables>,
}

/// One layer's groups, from its forward for its backward.
struct LayerGroups {
    /// The representatives' layer: token j is representative j.
    perm: Permutation,
    /// Per representative: its assignment in the layer (t · K + slot).
    reps: Vec<u32>,
    /// Per row of the layer's expert order: its representative's token.
    source: Vec<u32>,
}

impl LayerGroups {
    /// Whether row `i` of the layer's expert order (assignment `a`) is a
    /// representative.
    fn is_rep(&self, i: usize, a: u32) -> bool {
        self.reps[self.source[i] as usize] == a
    }
}

/// The runner that condenses each layer's rows before `inner` runs them.
pub(crate) struct Condensing<'r> {
    inner: &'r mut dyn ExpertRunner,
    step: StepCondense<'r>,
    k: usize,
    d: usize,
    layers: Vec<Option<LayerGroups>>,
    /// Assignments condensed into others in this runner's forwards.
    pub condensed: u64,
}

impl<'r> Condensing<'r> {
    fn new(inner: &'r mut dyn ExpertRunner, step: StepCondense<'r>, model: &ModelConfig) -> Self {
        Self {
            inner,
            step,
            k: model.top_k,
            d: model.d_model,
            layers: (0..model.layers).map(|_| None).collect(),
            condensed: 0,
        }
    }

    /// The groups of `perm`'s rows of `x`, or `None` where none condenses.
    fn groups(&self, perm: &Permutation, x: &[f32]) -> Option<LayerGroups> {
        let (k, d) = (self.k, self.d);
        let t = x.len() / d;
        let inv = inverse_norms(x, t, d);
        let signed = self.step.signatures.map(|s| (s.sign(x, t), s.tables));
        let signatures = signed.as_ref().map(|(s, tables)| (&s[..], *tables));
        let experts = perm.offsets.len() - 1;
        let mut reps = Vec::new();
        let mut counts = vec![0u32; experts];
        let mut source = vec![0u32; perm.order.len()];
        let mut condensed = 0;
        let mut tokens = Vec::new();
        for (e, count) in counts.iter_mut().enumerate() {
            let rows = perm.rows(e);
            tokens.clear();
            tokens.extend(rows.iter().map(|&a| a / k as u32));
            let g = condense_rows(
                &tokens,
                x,
                d,
                &inv,
                signatures,
                self.step.threshold,
                self.step.max_share,
            );
            condensed += g.condensed;
            let base = perm.span(e).start;
            for (r, &rep) in g.rep_of.iter().enumerate() {
                if rep as usize == r {
                    source[base + r] = reps.len() as u32;
                    reps.push(rows[r]);
                    *count += 1;
                } else {
                    source[base + r] = source[base + rep as usize];
                }
            }
        }
        if condensed == 0 {
            return None;
        }
        // The runners read each expert's rows (`order`) and spans, never
        // `position`, which `from_counts` leaves empty.
        let perm = Permutation {
            order: (0..reps.len() as u32).map(|j| j * k as u32).collect(),
            ..Permutation::from_counts(&counts)
        };
        Some(LayerGroups { perm, reps, source })
    }

    /// The representatives' input rows (one token each).
    fn rep_rows(&mut self, groups: &LayerGroups, x: &[f32]) -> Vec<f32> {
        let mut rows = self.inner.take_buffer(groups.reps.len() * self.d);
        gather_forward(&mut rows, x, &groups.reps, self.k, self.d);
        rows
    }
}

impl ExpertRunner for Condensing<'_> {
    fn take_buffer(&mut self, len: usize) -> Vec<f32> {
        self.inner.take_buffer(len)
    }

    fn give_buffer(&mut self, buf: Vec<f32>) {
        self.inner.give_buffer(buf);
    }

    fn dense_grad_final(&mut self, grad: &[f32], range: std::ops::Range<usize>) {
        self.inner.dense_grad_final(grad, range);
    }

    fn forward_layer(
        &mut self,
        layer: usize,
        perm: &Permutation,
        x: &[f32],
        out: &mut [f32],
    ) -> Result<(), EngineError> {
        let d = self.d;
        let Some(groups) = self.groups(perm, x) else {
            self.layers[layer] = None;
            return self.inner.forward_layer(layer, perm, x, out);
        };
        self.condensed += (perm.order.len() - groups.reps.len()) as u64;
        let xr = self.rep_rows(&groups, x);
        let mut yr = self.inner.take_buffer(groups.reps.len() * d); // written whole
        let ran = self.inner.forward_layer(layer, &groups.perm, &xr, &mut yr);
        self.inner.give_buffer(xr);
        ran?;
        for (row, &j) in out.chunks_exact_mut(d).zip(&groups.source) {
            row.copy_from_slice(&yr[j as usize * d..(j as usize + 1) * d]);
        }
        self.inner.give_buffer(yr);
        self.layers[layer] = Some(groups);
        Ok(())
    }

    fn backward_layer(
        &mut self,
        layer: usize,
        perm: &Permutation,
        x: &[f32],
        dout: AssignmentGrads<'_, f32>,
        dx: &mut [f32],
        last_micro_batch: bool,
    ) -> Result<(), EngineError> {
        let (k, d) = (self.k, self.d);
        let Some(groups) = self.layers[layer].take() else {
            return self
                .inner
                .backward_layer(layer, perm, x, dout, dx, last_micro_batch);
        };
        let n = groups.reps.len();
        let mut dy = self.inner.take_buffer(n * d); // each row set by its representative
        for (i, &a) in perm.order.iter().enumerate() {
            let j = groups.source[i] as usize;
            let (w, t) = (dout.weights[a as usize], a as usize / k);
            let (to, from) = (&mut dy[j * d..(j + 1) * d], &dout.dy[t * d..(t + 1) * d]);
            if groups.is_rep(i, a) {
                to.iter_mut().zip(from).for_each(|(o, &g)| *o = w * g);
            } else {
                to.iter_mut().zip(from).for_each(|(o, &g)| *o += w * g);
            }
        }
        let mut ones = self.inner.take_buffer(n * k);
        ones.fill(1.0);
        let xr = self.rep_rows(&groups, x);
        let mut dxr = self.inner.take_buffer(n * d); // written whole
        let summed = AssignmentGrads {
            dy: &dy,
            weights: &ones,
            k,
            d,
        };
        let ran =
            self.inner
                .backward_layer(layer, &groups.perm, &xr, summed, &mut dxr, last_micro_batch);
        self.inner.give_buffer(xr);
        self.inner.give_buffer(dy);
        self.inner.give_buffer(ones);
        ran?;
        for ((i, row), &a) in dx.chunks_exact_mut(d).enumerate().zip(&perm.order) {
            if groups.is_rep(i, a) {
                let j = groups.source[i] as usize;
                row.copy_from_slice(&dxr[j * d..(j + 1) * d]);
            } else {
                row.fill(0.0);
            }
        }
        self.inner.give_buffer(dxr);
        Ok(())
    }
}
