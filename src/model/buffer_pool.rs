//! f32 buffers kept between uses. A layer's (T·K, D) buffers (its experts'
//! outputs in assignment order, and their gradients) pass glibc's largest
//! mmap threshold (32 MiB) at a few thousand tokens: allocated afresh, each
//! comes from a new mapping and its every page faults on first touch (at
//! 16 384 tokens of d_model 512, top-2, 430 000 faults a step). Kept here,
//! the next step's layers reuse them.

/// Up to `max_kept` buffers between uses (a bound set when the pool is
/// made); a buffer of another length, or one more than the bound, is
/// dropped rather than kept.
#[derive(Debug, Default)]
pub struct F32BufferPool {
    kept: Vec<Vec<f32>>,
    max_kept: usize,
}

impl F32BufferPool {
    pub fn new(max_kept: usize) -> Self {
        Self {
            kept: Vec::new(),
            max_kept,
        }
    }

    /// `len` zeros: a kept buffer of that length, zeroed over the cores,
    /// or a new one.
    pub fn take(&mut self, len: usize) -> Vec<f32> {
        match self.kept.iter().position(|b| b.len() == len) {
            Some(i) => {
                let mut buf = self.kept.swap_remove(i);
                crate::parallel::fill_zeros(&mut buf);
                buf
            }
            None => vec![0.0; len],
        }
    }

    /// Keeps `buf` for a later `take`, within the bound. Buffers of a
    /// length no longer asked for (the token count changed) go first.
    pub fn give(&mut self, buf: Vec<f32>) {
        if buf.is_empty() || self.max_kept == 0 {
            return;
        }
        if self.kept.len() == self.max_kept {
            match self.kept.iter().position(|b| b.len() != buf.len()) {
                Some(i) => {
                    self.kept.swap_remove(i);
                }
                None => return,
            }
        }
        self.kept.push(buf);
    }

    #[cfg(test)]
    pub fn kept(&self) -> usize {
        self.kept.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_buffers_come_back_zeroed_and_within_the_bound() {
        let mut pool = F32BufferPool::new(2);
        let mut a = pool.take(1000);
        assert!(a.iter().all(|&v| v == 0.0));
        a.fill(3.0);
        let ptr = a.as_ptr();
        pool.give(a);
        let b = pool.take(1000);
        assert_eq!(b.as_ptr(), ptr, "the kept buffer is reused");
        assert!(b.iter().all(|&v| v == 0.0));
        // A length not kept is a new buffer.
        assert_eq!(pool.take(10).len(), 10);
        pool.give(b);
        pool.give(vec![1.0; 1000]);
        pool.give(vec![1.0; 1000]); // over the bound: dropped
        assert_eq!(pool.kept(), 2);
        // A new length displaces an old one.
        pool.give(vec![1.0; 500]);
        assert_eq!(pool.kept(), 2);
        assert_eq!(pool.take(500), vec![0.0; 500]);
        assert_eq!(F32BufferPool::new(0).take(4), vec![0.0; 4]);
    }
}
