//! The dense weights on the GPU between updates. The engine tells the
//! backend where its dense params live and when they change
//! ([`DenseKernels::weights_changed`]); a GEMM whose weight is a slice of
//! those params uploads it on first use and every later GEMM until the
//! next change reads it in place, so a step uploads each weight once
//! rather than once per forward, backward and micro-batch. Weights from
//! anywhere else are uploaded per call, as before.
//!
//! Bound: the cached slices are disjoint views of the registered params
//! (a request that overlaps a cached slice without equalling it is not
//! cached), so they never hold more than the params' own size, the
//! device memory `strata plan` and the trainer's fit check already set
//! aside for the dense params.

use std::collections::HashMap;
use std::sync::Arc;

use crate::EngineError;

/// Uploaded slices (of type `U`: a `CudaSlice` on the GPU) of the
/// registered dense params.
pub(super) struct WeightCache<U> {
    /// The registered params: start address and length in f32.
    region: Option<(usize, usize)>,
    /// (offset, length) in the params → its upload.
    slices: HashMap<(usize, usize), Arc<U>>,
    /// Sorted (offset, end) of the cached slices, to refuse overlaps.
    spans: Vec<(usize, usize)>,
}

impl<U> Default for WeightCache<U> {
    fn default() -> Self {
        Self {
            region: None,
            slices: HashMap::new(),
            spans: Vec::new(),
        }
    }
}

impl<U> WeightCache<U> {
    /// The params at `dense` were (re)written: drop every upload and
    /// cache slices of `dense` from now on.
    pub fn reset(&mut self, dense: &[f32]) {
        self.slices.clear();
        self.spans.clear();
        self.region = Some((dense.as_ptr() as usize, dense.len()));
    }

    /// Where `w` lies in the registered params, if it does.
    fn place(&self, w: &[f32]) -> Option<(usize, usize)> {
        let (start, len) = self.region?;
        let rel = (w.as_ptr() as usize).checked_sub(start)?;
        if w.is_empty() || rel % 4 != 0 {
            return None;
        }
        let offset = rel / 4;
        (offset + w.len() <= len).then_some((offset, w.len()))
    }

    /// The cached upload of `w`, or `upload(w)`'s, kept when `w` is a
    /// slice of the registered params that overlaps no other cached slice.
    pub fn get_or_upload(
        &mut self,
        w: &[f32],
        upload: impl FnOnce(&[f32]) -> Result<U, EngineError>,
    ) -> Result<Arc<U>, EngineError> {
        let Some(key) = self.place(w) else {
            return Ok(Arc::new(upload(w)?));
        };
        if let Some(slice) = self.slices.get(&key) {
            return Ok(Arc::clone(slice));
        }
        let slice = Arc::new(upload(w)?);
        let (lo, hi) = (key.0, key.0 + key.1);
        let at = self.spans.partition_point(|&(start, _)| start < lo);
        let clear_before = at == 0 || self.spans[at - 1].1 <= lo;
        let clear_after = at == self.spans.len() || self.spans[at].0 >= hi;
        if clear_before && clear_after {
            self.spans.insert(at, (lo, hi));
            self.slices.insert(key, Arc::clone(&slice));
        }
        Ok(slice)
    }

    /// f32 elements held on the GPU.
    #[cfg(test)]
    pub fn cached_len(&self) -> usize {
        self.spans.iter().map(|&(lo, hi)| hi - lo).sum()
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
}
