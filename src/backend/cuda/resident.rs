//! The dense params the GPU holds, stepped on the GPU ([`DenseResidence`]).
//!
//! The weights are the held slices of the weight cache (`weights.rs`):
//! each uploaded on its first use and, from the first [`step`] on, newer
//! here than on the host. Their gradients are the weight-gradient
//! accumulators of the step; their AdamW moments are uploaded from the
//! host's the first time a slice is stepped and stay here. The `adamw`
//! kernel is strata-optim's element update bit for bit, so a step here
//! gives the params the host's AdamW would from the same gradient.
//!
//! What the host wrote into the held part of the gradient (a kernel that
//! ran on host slices) is added here, never lost: the first step looks
//! for such writes, and once one is seen every step looks.
//!
//! [`step`]: DenseResidence::step

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::ops::Range;

use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, PushKernelArg};
use strata_optim::StepScalars;

use super::dense::threads;
use super::{gpu_error, CudaBackend};
use crate::model::{trainable_parts, DenseResidence};
use crate::EngineError;

/// Elements a thread of `square_sums` adds.
const SQUARE_SUM_CHUNK: usize = 4096;

/// A held slice's AdamW moments, each its length (the frozen parts unused).
struct Moments {
    m: CudaSlice<f32>,
    v: CudaSlice<f32>,
}

/// What the GPU keeps for the params it holds besides the params.
#[derive(Default)]
pub(super) struct Resident {
    moments: HashMap<(usize, usize), Moments>,
    /// The held slices' gradients, from `finish_grads` to `step`.
    grads: HashMap<(usize, usize), CudaSlice<f32>>,
    /// Whether the host has written into the held part of a gradient:
    /// `None` until the first `finish_grads` has looked.
    host_writes: Option<bool>,
}

impl Resident {
    /// The params were written on the host: what is kept for them goes.
    pub fn reset(&mut self) {
        self.moments.clear();
        self.grads.clear();
    }
}

fn span(key: (usize, usize)) -> Range<usize> {
    key.0..key.0 + key.1
}

/// `part` (a range of the params) relative to the held slice at `key`.
fn within(part: &Range<usize>, key: (usize, usize)) -> Range<usize> {
    part.start - key.0..part.end - key.0
}

impl DenseResidence for CudaBackend {
    fn finish_grads(
        &self,
        grad: &mut [f32],
        trainable: &[Range<usize>],
        norm: bool,
    ) -> Result<f64, EngineError> {
        self.bind()?;
        let sums = self
            .grads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .finish(grad);
        let held = self
            .weights
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .keys();
        let mut state = self.resident.lock().unwrap_or_else(|p| p.into_inner());
        state.grads.clear();
        let (kept, host): (Vec<_>, Vec<_>) = sums
            .into_iter()
            .partition(|(key, _)| held.binary_search(key).is_ok());
        state.grads.extend(kept);
        // Their params are the host's to step.
        self.add_sums_to_host(grad, host)?;
        if state.host_writes != Some(false) || cfg!(debug_assertions) {
            let mut seen = state.host_writes == Some(true);
            for &key in &held {
                let part = &mut grad[span(key)];
                if part.iter().all(|&g| g == 0.0) {
                    continue;
                }
                seen = true;
                let written = self.upload(part)?;
                part.fill(0.0);
                match state.grads.get_mut(&key) {
                    Some(acc) => self.add_into(acc, &written)?,
                    None => {
                        state.grads.insert(key, written);
                    }
                }
            }
            state.host_writes = Some(seen);
        }
        if !norm {
            return Ok(0.0);
        }
        // In the params' order, so the sum is the same bits every run.
        let mut keys: Vec<_> = state.grads.keys().copied().collect();
        keys.sort_unstable();
        let parts = keys.iter().flat_map(|&key| {
            let acc = &state.grads[&key];
            trainable_parts(span(key), trainable)
                .into_iter()
                .map(move |(part, _)| acc.slice(within(&part, key)))
        });
        self.square_sum(parts.collect())
    }

    fn held(&self) -> Vec<Range<usize>> {
        let weights = self.weights.lock().unwrap_or_else(|p| p.into_inner());
        weights.keys().into_iter().map(span).collect()
    }

    fn step(
        &self,
        s: &StepScalars,
        trainable: &[Range<usize>],
        m: &[f32],
        v: &[f32],
    ) -> Result<(), EngineError> {
        self.bind()?;
        let mut weights = self.weights.lock().unwrap_or_else(|p| p.into_inner());
        let mut state = self.resident.lock().unwrap_or_else(|p| p.into_inner());
        let state = &mut *state;
        for key in weights.keys() {
            let parts = trainable_parts(span(key), trainable);
            if parts.is_empty() {
                continue; // frozen
            }
            let mo = match state.moments.entry(key) {
                Entry::Occupied(e) => e.into_mut(),
                Entry::Vacant(e) => e.insert(self.upload_moments(key, &parts, m, v)?),
            };
            let g = match state.grads.entry(key) {
                Entry::Occupied(e) => e.into_mut(),
                // Used by no kernel this step: AdamW's decay still applies.
                Entry::Vacant(e) => e.insert(self.zeros(key.1)?),
            };
            let p = weights.get_mut(key).ok_or_else(|| {
                gpu_error("the dense step", "a kernel still reads a weight it updates")
            })?;
            for (part, _) in &parts {
                let r = within(part, key);
                self.adamw_view(
                    s,
                    &mut p.slice_mut(r.clone()),
                    &mut mo.m.slice_mut(r.clone()),
                    &mut mo.v.slice_mut(r.clone()),
                    &g.slice(r),
                )?;
            }
        }
        state.grads.clear();
        weights.mark_newer_here();
        self.drop_bf16_weights();
        Ok(())
    }

    fn sync(
        &self,
        params: &mut [f32],
        trainable: &[Range<usize>],
        m: &mut [f32],
        v: &mut [f32],
    ) -> Result<(), EngineError> {
        self.bind()?;
        let mut weights = self.weights.lock().unwrap_or_else(|p| p.into_inner());
        let state = self.resident.lock().unwrap_or_else(|p| p.into_inner());
        for key in weights.keys() {
            let p = weights.get_mut(key).ok_or_else(|| {
                gpu_error("reading the dense params", "a kernel still reads a weight")
            })?;
            self.download(p, &mut params[span(key)])?;
            let Some(mo) = state.moments.get(&key) else {
                continue; // never stepped here: the host's moments are current
            };
            for (part, packed) in trainable_parts(span(key), trainable) {
                let (r, n) = (within(&part, key), part.len());
                self.download_view(&mo.m.slice(r.clone()), &mut m[packed..packed + n])?;
                self.download_view(&mo.v.slice(r), &mut v[packed..packed + n])?;
            }
        }
        Ok(())
    }
}

impl CudaBackend {
    /// The moments of the held slice at `key`, its trainable `parts` read
    /// from the host's packed `m` and `v`.
    fn upload_moments(
        &self,
        key: (usize, usize),
        parts: &[(Range<usize>, usize)],
        m: &[f32],
        v: &[f32],
    ) -> Result<Moments, EngineError> {
        let mut moments = Moments {
            m: self.zeros(key.1)?,
            v: self.zeros(key.1)?,
        };
        for (part, packed) in parts {
            let (r, n) = (within(part, key), part.len());
            self.upload_into(&mut moments.m.slice_mut(r.clone()), &m[*packed..packed + n])?;
            self.upload_into(&mut moments.v.slice_mut(r), &v[*packed..packed + n])?;
        }
        Ok(moments)
    }

    fn upload_into(&self, dst: &mut CudaViewMut<'_, f32>, host: &[f32]) -> Result<(), EngineError> {
        self.count_pcie_other::<f32>(host.len());
        self.stream
            .memcpy_htod(host, dst)
            .map_err(|e| gpu_error("an upload", e))
    }

    fn download_view(&self, src: &CudaView<'_, f32>, host: &mut [f32]) -> Result<(), EngineError> {
        self.count_pcie_other::<f32>(host.len());
        self.stream
            .memcpy_dtoh(src, host)
            .map_err(|e| gpu_error("a download", e))
    }

    /// acc += x, element by element.
    pub(super) fn add_into(
        &self,
        acc: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
    ) -> Result<(), EngineError> {
        assert_eq!(acc.len(), x.len());
        let n = x.len() as u32;
        let mut launch = self.stream.launch_builder(&self.dense.add_into);
        launch.arg(acc).arg(x).arg(&n);
        // SAFETY: acc and x hold n f32 (asserted).
        unsafe { launch.launch(threads(x.len())) }.map_err(|e| gpu_error("add_into", e))?;
        Ok(())
    }

    /// The sum of squares of the values of `parts` in f64: partial sums
    /// of `SQUARE_SUM_CHUNK` elements on the GPU, one download for them
    /// all, added here in order.
    fn square_sum(&self, parts: Vec<CudaView<'_, f32>>) -> Result<f64, EngineError> {
        let chunks: Vec<usize> = parts
            .iter()
            .map(|x| x.len().div_ceil(SQUARE_SUM_CHUNK))
            .collect();
        let total: usize = chunks.iter().sum();
        if total == 0 {
            return Ok(0.0);
        }
        let mut partial = self
            .stream
            .alloc_zeros::<f64>(total)
            .map_err(|e| self.memory_error("allocating GPU memory", e))?;
        let mut at = 0;
        for (x, &n_chunks) in parts.iter().zip(&chunks) {
            if n_chunks == 0 {
                continue;
            }
            let (n32, chunk32) = (x.len() as u32, SQUARE_SUM_CHUNK as u32);
            let mut out = partial.slice_mut(at..at + n_chunks);
            let mut launch = self.stream.launch_builder(&self.dense.square_sums);
            launch.arg(x).arg(&n32).arg(&chunk32).arg(&mut out);
            // SAFETY: x holds n f32 and out one f64 for each of its
            // ceil(n / chunk) chunks, one thread a chunk.
            unsafe { launch.launch(threads(n_chunks)) }.map_err(|e| gpu_error("square_sums", e))?;
            at += n_chunks;
        }
        let mut host = vec![0.0f64; total];
        self.count_pcie_other::<f64>(total);
        self.stream
            .memcpy_dtoh(&partial, &mut host)
            .map_err(|e| gpu_error("a download", e))?;
        Ok(host.iter().sum())
    }
}
