//! Expert gradient buffers, kept from step to step.
//!
//! Every expert backward fills one f32 gradient of an expert's size, which
//! the optimizer holds until its update ends. Allocated afresh, each is new
//! memory from the OS: on the cpu backend its first touch is inside the
//! weight-gradient GEMM, a page fault and a page clear every 4 KiB (in
//! `strata bench step`, 50k faults a step, on one of the GEMM's two threads,
//! which the other then waits for). Buffers given back are kept here and
//! handed out again as they are: a device's backward overwrites its
//! gradient without reading it (`ExpertDevice::expert_backward`), so
//! zeroing one first would be a pass over an expert's size for nothing.
//!
//! A buffer is kept only once given back, so the pool never holds more than
//! the most gradients the engine had alive at once (the naive schedule
//! holds all of a step's; the expert-wise one, those of the updates in
//! flight), and never more than `max_kept`.

use std::sync::{Mutex, MutexGuard};

pub(crate) struct GradBuffers {
    len: usize,
    max_kept: usize,
    kept: Mutex<Vec<Vec<f32>>>,
    /// Buffers made here and not freed here (in use or kept), and the most
    /// there have been: the memory the engine has held for gradients. (A
    /// buffer dropped elsewhere stays counted.)
    held: Mutex<(usize, usize)>,
}

impl GradBuffers {
    /// Buffers of `len` elements; at most `max_kept` kept.
    pub fn new(len: usize, max_kept: usize) -> Self {
        Self {
            len,
            max_kept,
            kept: Mutex::new(Vec::with_capacity(max_kept)),
            held: Mutex::new((0, 0)),
        }
    }

    /// The most buffers held at once so far (see the field).
    #[cfg(test)]
    pub fn held_max(&self) -> usize {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).1
    }

    fn count_held(&self, change: isize) {
        let mut held = self.held.lock().unwrap_or_else(|p| p.into_inner());
        held.0 = held.0.saturating_add_signed(change);
        held.1 = held.1.max(held.0);
    }

    fn kept(&self) -> MutexGuard<'_, Vec<Vec<f32>>> {
        // The list is valid after any panic (a push or a pop).
        self.kept.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A buffer of the gradient's length: a kept one, holding whatever
    /// its last user left there, or a new zeroed one.
    pub fn take(&self) -> Vec<f32> {
        let kept = self.kept().pop();
        kept.unwrap_or_else(|| {
            self.count_held(1);
            vec![0.0; self.len]
        })
    }

    /// Gives a buffer back; kept while fewer than `max_kept` are, else
    /// freed. A buffer of another length (none is made here) is freed.
    pub fn give(&self, buf: Vec<f32>) {
        if buf.len() != self.len {
            return;
        }
        let mut kept = self.kept();
        if kept.len() < self.max_kept {
            kept.push(buf);
        } else {
            drop(kept);
            self.count_held(-1);
        }
    }

    #[cfg(test)]
    fn kept_count(&self) -> usize {
        self.kept().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_reused_as_they_are_and_no_more_than_max_are_kept() {
        let pool = GradBuffers::new(5, 2);
        let mut a = pool.take();
        assert_eq!(a, vec![0.0; 5]);
        a.iter_mut().for_each(|x| *x = 3.0);
        let ptr = a.as_ptr();
        pool.give(a);
        let b = pool.take();
        assert_eq!(b.as_ptr(), ptr, "the kept buffer is reused");
        assert_eq!(b, vec![3.0; 5], "as it was given back");
        pool.give(b);
        pool.give(vec![1.0; 5]);
        pool.give(vec![1.0; 5]);
        assert_eq!(pool.kept_count(), 2);
        pool.give(vec![1.0; 4]);
        assert_eq!(pool.kept_count(), 2);
        for _ in 0..3 {
            assert_eq!(pool.take().len(), 5);
        }
        assert_eq!(pool.kept_count(), 0);
    }

    #[test]
    fn the_buffers_held_count_those_kept_and_in_use_not_those_freed() {
        let pool = GradBuffers::new(5, 2);
        let three: Vec<_> = (0..3).map(|_| pool.take()).collect();
        assert_eq!(pool.held_max(), 3);
        three.into_iter().for_each(|b| pool.give(b)); // the third freed
                                                      // Two kept, a third made: three held again, never four.
        let again: Vec<_> = (0..3).map(|_| pool.take()).collect();
        assert_eq!(pool.held_max(), 3);
        again.into_iter().for_each(|b| pool.give(b));
        let four: Vec<_> = (0..4).map(|_| pool.take()).collect();
        assert_eq!(pool.held_max(), 4);
        drop(four);
    }
}
