//! The dense weights and their gradients on the GPU for a step.
//!
//! Weights: the engine tells the backend where its dense params live and
//! when they change ([`weights_changed`]); a GEMM whose weight is a slice
//! of those params uploads it on first use and every later GEMM until the
//! next change reads it in place, so a step uploads each weight once
//! rather than once per forward, backward and micro-batch.
//!
//! Gradients: between [`grads_begin`] and [`grads_flush`] a GEMM whose
//! weight gradient is a slice of the registered gradient sums into a
//! zeroed GPU accumulator instead of uploading and downloading that slice
//! per call; the flush adds each accumulator into its slice once (what
//! the cpu code wrote there, such as a tied embedding's gradient, stays
//! and is added to).
//!
//! Slices from anywhere else go up and come down per call, as before.
//! Bound: the held slices are disjoint views of the registered vector (a
//! request that overlaps a held slice without equalling it is not held),
//! so each cache holds at most the params' own size: the device memory
//! `strata plan` and the trainer's fit check set aside for the dense
//! params and their gradients.
//!
//! [`weights_changed`]: crate::model::DenseKernels::weights_changed
//! [`grads_begin`]: crate::model::DenseKernels::grads_begin
//! [`grads_flush`]: crate::model::DenseKernels::grads_flush

use std::collections::HashMap;
use std::sync::Arc;

use crate::EngineError;

/// Where slices of one registered host vector lie, as (offset, length).
#[derive(Default)]
struct Region {
    /// Start address and length in f32.
    bounds: Option<(usize, usize)>,
    /// Sorted (offset, end) of the held slices, to refuse overlaps.
    spans: Vec<(usize, usize)>,
}

impl Region {
    fn reset(&mut self, v: Option<&[f32]>) {
        self.bounds = v.map(|v| (v.as_ptr() as usize, v.len()));
        self.spans.clear();
    }

    /// Where `w` lies in the registered vector, if it does.
    fn place(&self, w: &[f32]) -> Option<(usize, usize)> {
        let (start, len) = self.bounds?;
        let rel = (w.as_ptr() as usize).checked_sub(start)?;
        if w.is_empty() || rel % 4 != 0 {
            return None;
        }
        let offset = rel / 4;
        (offset + w.len() <= len).then_some((offset, w.len()))
    }

    /// Records `key` as held unless it overlaps a held slice; says which.
    fn hold(&mut self, key: (usize, usize)) -> bool {
        let (lo, hi) = (key.0, key.0 + key.1);
        let at = self.spans.partition_point(|&(start, _)| start < lo);
        let clear_before = at == 0 || self.spans[at - 1].1 <= lo;
        let clear_after = at == self.spans.len() || self.spans[at].0 >= hi;
        if clear_before && clear_after {
            self.spans.insert(at, (lo, hi));
        }
        clear_before && clear_after
    }

    #[cfg(test)]
    fn held_len(&self) -> usize {
        self.spans.iter().map(|&(lo, hi)| hi - lo).sum()
    }
}

/// Uploaded slices (of type `U`: a `CudaSlice` on the GPU) of the
/// registered dense params.
pub(super) struct WeightCache<U> {
    region: Region,
    /// (offset, length) in the params → its upload.
    slices: HashMap<(usize, usize), Arc<U>>,
    /// The held slices were updated here (`DenseResidence::step`), so the
    /// host's copy of them is older: a slice overlapping one of them
    /// cannot be uploaded from the host.
    newer_here: bool,
}

impl<U> Default for WeightCache<U> {
    fn default() -> Self {
        Self {
            region: Region::default(),
            slices: HashMap::new(),
            newer_here: false,
        }
    }
}

impl<U> WeightCache<U> {
    /// The params at `dense` were (re)written: drop every upload and
    /// cache slices of `dense` from now on.
    pub fn reset(&mut self, dense: &[f32]) {
        self.slices.clear();
        self.region.reset(Some(dense));
        self.newer_here = false;
    }

    /// The held slices, as (offset, length) in the params, in order.
    pub fn keys(&self) -> Vec<(usize, usize)> {
        let mut keys: Vec<_> = self.slices.keys().copied().collect();
        keys.sort_unstable();
        keys
    }

    /// The held slice at `key`, to update in place; `None` while a GEMM
    /// still reads it.
    pub fn get_mut(&mut self, key: (usize, usize)) -> Option<&mut U> {
        self.slices.get_mut(&key).and_then(Arc::get_mut)
    }

    /// `w`'s (offset, length) in the params where it is a held slice.
    pub fn held_key(&self, w: &[f32]) -> Option<(usize, usize)> {
        self.region
            .place(w)
            .filter(|key| self.slices.contains_key(key))
    }

    /// The held slices were updated here: from now on the host's copy of
    /// them is older than these.
    pub fn mark_newer_here(&mut self) {
        self.newer_here = true;
    }

    /// The cached upload of `w`, or `upload(w)`'s, kept when `w` is a
    /// slice of the registered params that overlaps no other cached slice.
    pub fn get_or_upload(
        &mut self,
        w: &[f32],
        upload: impl FnOnce(&[f32]) -> Result<U, EngineError>,
    ) -> Result<Arc<U>, EngineError> {
        let Some(key) = self.region.place(w) else {
            return Ok(Arc::new(upload(w)?));
        };
        if let Some(slice) = self.slices.get(&key) {
            return Ok(Arc::clone(slice));
        }
        let held = self.region.hold(key);
        if !held && self.newer_here {
            return Err(EngineError::Config(format!(
                "a dense weight of {} params at {} overlaps one the GPU holds and has \
                 updated: a network must ask for its weights as the same slices every step",
                key.1, key.0
            )));
        }
        let slice = Arc::new(upload(w)?);
        if held {
            self.slices.insert(key, Arc::clone(&slice));
        }
        Ok(slice)
    }

    /// f32 elements held on the GPU.
    #[cfg(test)]
    pub fn cached_len(&self) -> usize {
        self.region.held_len()
    }
}

/// Zeroed accumulators (of type `U`) for slices of the registered dense
/// gradient.
pub(super) struct GradCache<U> {
    region: Region,
    /// (offset, length) in the gradient → its accumulator.
    sums: HashMap<(usize, usize), U>,
}

impl<U> Default for GradCache<U> {
    fn default() -> Self {
        Self {
            region: Region::default(),
            sums: HashMap::new(),
        }
    }
}

impl<U> GradCache<U> {
    /// Accumulate slices of `grad` from now on (dropping anything an
    /// unfinished step left).
    pub fn begin(&mut self, grad: &[f32]) {
        self.sums.clear();
        self.region.reset(Some(grad));
    }

    /// The accumulator for `dw` (made by `zeros(len)` on first use), or
    /// `None` when `dw` is not a slice of the registered gradient or
    /// overlaps another held one.
    pub fn accumulator(
        &mut self,
        dw: &[f32],
        zeros: impl FnOnce(usize) -> Result<U, EngineError>,
    ) -> Result<Option<&mut U>, EngineError> {
        let Some(key) = self.region.place(dw) else {
            return Ok(None);
        };
        if !self.sums.contains_key(&key) {
            if !self.region.hold(key) {
                return Ok(None);
            }
            self.sums.insert(key, zeros(key.1)?);
        }
        Ok(self.sums.get_mut(&key))
    }

    /// Ends accumulation into `grad` (the vector `begin` registered):
    /// every accumulator with its (offset, length) in it, for the caller
    /// to add in.
    pub fn finish(&mut self, grad: &[f32]) -> Vec<((usize, usize), U)> {
        assert!(
            self.sums.is_empty()
                || self.region.bounds == Some((grad.as_ptr() as usize, grad.len())),
            "grads_flush is given the gradient grads_begin registered"
        );
        self.region.reset(None);
        self.sums.drain().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts uploads; an upload is a copy of the slice.
    fn cache_with(dense: &[f32]) -> WeightCache<Vec<f32>> {
        let mut cache = WeightCache::default();
        cache.reset(dense);
        cache
    }

    #[test]
    fn slices_of_the_params_upload_once_until_they_change() {
        let mut dense: Vec<f32> = (0..100).map(|i| i as f32).collect();
        let mut cache = cache_with(&dense);
        let mut uploads = 0;
        let mut get = |cache: &mut WeightCache<Vec<f32>>, w: &[f32]| {
            cache
                .get_or_upload(w, |w| {
                    uploads += 1;
                    Ok(w.to_vec())
                })
                .unwrap()
        };
        assert_eq!(*get(&mut cache, &dense[10..30]), dense[10..30]);
        assert_eq!(*get(&mut cache, &dense[10..30]), dense[10..30]);
        assert_eq!(*get(&mut cache, &dense[30..40]), dense[30..40]);
        // Overlapping a cached slice: uploaded, not kept.
        assert_eq!(*get(&mut cache, &dense[20..35]), dense[20..35]);
        assert_eq!(*get(&mut cache, &dense[20..35]), dense[20..35]);
        // Not a slice of the params: uploaded every time.
        let other = vec![7.0f32; 5];
        get(&mut cache, &other);
        get(&mut cache, &other);
        assert_eq!(cache.cached_len(), 30);
        // The params change: the next GEMM sees the new values.
        dense[15] = -1.0;
        cache.reset(&dense);
        assert_eq!(cache.cached_len(), 0);
        assert_eq!(get(&mut cache, &dense[10..30])[5], -1.0);
        assert_eq!(uploads, 2 + 2 + 2 + 1);
    }

    #[test]
    fn a_slice_overlapping_one_updated_here_is_refused() {
        let dense: Vec<f32> = (0..100).map(|i| i as f32).collect();
        let mut cache = cache_with(&dense);
        let upload = |w: &[f32]| Ok(w.to_vec());
        cache.get_or_upload(&dense[10..30], upload).unwrap();
        cache.get_mut((10, 20)).unwrap()[0] = -5.0;
        cache.mark_newer_here();
        assert_eq!(cache.keys(), vec![(10, 20)]);
        // The held slice is what was updated here, not the host's.
        assert_eq!(
            cache.get_or_upload(&dense[10..30], upload).unwrap()[0],
            -5.0
        );
        // A slice apart from it still comes from the host.
        assert_eq!(
            cache.get_or_upload(&dense[40..50], upload).unwrap()[0],
            40.0
        );
        let err = cache.get_or_upload(&dense[20..35], upload).unwrap_err();
        assert!(
            err.to_string().contains("overlaps one the GPU holds"),
            "{err}"
        );
        // A GEMM still reading a slice keeps it from being updated.
        let reading = cache.get_or_upload(&dense[10..30], upload).unwrap();
        assert!(cache.get_mut((10, 20)).is_none());
        drop(reading);
        assert!(cache.get_mut((10, 20)).is_some());
    }

    #[test]
    fn gradient_slices_accumulate_apart_until_the_flush() {
        let grad = vec![0.0f32; 50];
        let mut cache: GradCache<Vec<f32>> = GradCache::default();
        cache.begin(&grad);
        let mut made = 0;
        for _ in 0..3 {
            let acc = cache
                .accumulator(&grad[10..20], |n| {
                    made += 1;
                    Ok(vec![0.0; n])
                })
                .unwrap()
                .unwrap();
            acc.iter_mut().for_each(|v| *v += 1.0);
        }
        assert_eq!(made, 1);
        // Overlapping a held slice, or outside the gradient: not held.
        assert!(cache
            .accumulator(&grad[15..25], |n| Ok(vec![0.0; n]))
            .unwrap()
            .is_none());
        let other = vec![0.0f32; 4];
        assert!(cache
            .accumulator(&other, |n| Ok(vec![0.0; n]))
            .unwrap()
            .is_none());
        let sums = cache.finish(&grad);
        assert_eq!(sums, vec![((10, 10), vec![3.0; 10])]);
        assert!(cache
            .accumulator(&grad[10..20], |n| Ok(vec![0.0; n]))
            .unwrap()
            .is_none());
    }
}
