//! f32 buffers kept between uses. A layer's (T·K, D) buffers (its experts'
//! outputs in expert order, and the gradients of their inputs) pass glibc's largest
//! mmap threshold (32 MiB) at a few thousand tokens, its (T, D) ones at
//! twice as many: allocated afresh, each comes from a new mapping (unless
//! the program turned malloc's mmap off, as the `strata` binary does) and
//! its every page faults on first touch (at 16 384 tokens of d_model 512,
//! top-2, 430 000 faults a step). Kept here, the next step's layers reuse
//! them, unzeroed, since every user writes them whole.
//!
//! [`ScratchBuffers`] keeps the per-expert buffers (an expert's input rows
//! and its output's gradient; on several devices, its output and its
//! input's gradient too, until they go back to their tokens' devices) that
//! their users overwrite whole: taking one then costs no zeroing.

/// Up to `max_kept` buffers between uses (a bound set when the pool is
/// made). When full, a buffer given back displaces the one given back
/// longest ago: after the token count changes, the old lengths, which no
/// one takes any more, go first, and a length in use is never displaced
/// by another while a stale one is kept.
#[derive(Debug, Default)]
pub struct F32BufferPool {
    /// Each kept buffer with the `given` count when it came back.
    kept: Vec<(u64, Vec<f32>)>,
    max_kept: usize,
    given: u64,
}

impl F32BufferPool {
    pub fn new(max_kept: usize) -> Self {
        Self {
            kept: Vec::new(),
            max_kept,
            given: 0,
        }
    }

    /// `len` floats that the caller writes whole before reading: a kept
    /// buffer of that length as its last user left it, or new zeros.
    pub fn take(&mut self, len: usize) -> Vec<f32> {
        match self.kept.iter().position(|(_, b)| b.len() == len) {
            Some(i) => self.kept.swap_remove(i).1,
            None => vec![0.0; len],
        }
    }

    /// Keeps `buf` for a later `take`, within the bound (see the type).
    pub fn give(&mut self, buf: Vec<f32>) {
        if buf.is_empty() || self.max_kept == 0 {
            return;
        }
        if self.kept.len() == self.max_kept {
            let oldest = (0..self.kept.len())
                .min_by_key(|&i| self.kept[i].0)
                .expect("a full pool keeps at least one buffer");
            self.kept.swap_remove(oldest);
        }
        self.given += 1;
        self.kept.push((self.given, buf));
    }

    #[cfg(test)]
    pub fn kept(&self) -> usize {
        self.kept.len()
    }
}

/// f32 buffers whose users write every element before reading any,
/// kept between uses with what they last held: taking one zeroes nothing
/// but the length by which it grows past the longest it has been (once
/// the largest request has been seen, nothing). At most `max_kept` (a
/// bound set when made) are kept; a buffer given back beyond it is
/// dropped.
#[derive(Debug, Default)]
pub struct ScratchBuffers {
    kept: Vec<Vec<f32>>,
    max_kept: usize,
}

/// A buffer from [`ScratchBuffers`]: the first `len` floats of a kept
/// buffer, of unspecified value (whatever an earlier user left, or
/// zeros) until its user writes them.
#[derive(Debug)]
pub struct ScratchBuf {
    buf: Vec<f32>,
    len: usize,
}

impl std::ops::Deref for ScratchBuf {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf[..self.len]
    }
}

impl std::ops::DerefMut for ScratchBuf {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[..self.len]
    }
}

impl ScratchBuffers {
    pub fn new(max_kept: usize) -> Self {
        Self {
            kept: Vec::new(),
            max_kept,
        }
    }

    /// `len` floats that the caller overwrites whole before reading: the
    /// longest kept buffer, grown to exactly `len` (zeroing what it gains)
    /// if short, so that no buffer holds more than the longest asked for.
    pub fn take(&mut self, len: usize) -> ScratchBuf {
        let longest = (0..self.kept.len()).max_by_key(|&i| self.kept[i].len());
        let mut buf = longest.map_or_else(Vec::new, |i| self.kept.swap_remove(i));
        if buf.len() < len {
            crate::math::resize_exact(&mut buf, len, 0.0);
        }
        ScratchBuf { buf, len }
    }

    /// Keeps `buf` for a later `take`, within the bound.
    pub fn give(&mut self, buf: ScratchBuf) {
        if !buf.buf.is_empty() && self.kept.len() < self.max_kept {
            self.kept.push(buf.buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scratch_buffers_are_reused_unzeroed_within_the_bound() {
        let mut scratch = ScratchBuffers::new(2);
        let mut a = scratch.take(1000);
        assert_eq!(a.len(), 1000);
        a.fill(3.0);
        let ptr = a.as_ptr();
        scratch.give(a);
        // Shorter, then as long again: the same memory, as it was left.
        let b = scratch.take(600);
        assert_eq!((b.as_ptr(), b.len()), (ptr, 600));
        assert!(b.iter().all(|&v| v == 3.0));
        scratch.give(b);
        let c = scratch.take(1000);
        assert_eq!(c.as_ptr(), ptr);
        assert!(c.iter().all(|&v| v == 3.0));
        scratch.give(c);
        // Longer than it has been: the old part as it was, the rest zeros.
        let d = scratch.take(1200);
        assert_eq!(d.len(), 1200);
        // Grown to exactly that (a `Vec` doubles: 2000).
        assert_eq!(d.buf.capacity(), 1200);
        assert!(d[..1000].iter().all(|&v| v == 3.0));
        assert!(d[1000..].iter().all(|&v| v == 0.0));
        scratch.give(d);
        let small = |n| {
            let mut s = ScratchBuffers::new(1);
            s.take(n)
        };
        scratch.give(small(10));
        scratch.give(small(10)); // over the bound: dropped
        assert_eq!(scratch.kept.len(), 2);
        // The longest kept buffer serves the next request.
        assert_eq!(scratch.take(5).buf.len(), 1200);
        assert_eq!(ScratchBuffers::new(0).take(3).len(), 3);
    }

    #[test]
    fn kept_buffers_come_back_as_left_and_within_the_bound() {
        let mut pool = F32BufferPool::new(2);
        let mut a = pool.take(1000);
        assert!(a.iter().all(|&v| v == 0.0));
        a.fill(3.0);
        let ptr = a.as_ptr();
        pool.give(a);
        let b = pool.take(1000);
        assert_eq!(b.as_ptr(), ptr, "the kept buffer is reused");
        assert!(b.iter().all(|&v| v == 3.0), "and not zeroed");
        // A length not kept is a new buffer.
        assert_eq!(pool.take(10).len(), 10);
        pool.give(b);
        pool.give(vec![1.0; 1000]);
        pool.give(vec![2.0; 1000]); // over the bound: the oldest goes
        assert_eq!(pool.kept(), 2);
        assert_eq!(pool.take(1000), vec![1.0; 1000]);
        assert_eq!(pool.take(1000), vec![2.0; 1000]);
        assert_eq!(F32BufferPool::new(0).take(4), vec![0.0; 4]);
    }

    /// Two lengths in use side by side (a layer's (T·K, D) and (T, D)
    /// buffers) and a stale one from an earlier token count: a full pool
    /// drops the stale buffer, the one given back longest ago, not the
    /// first it finds of another length.
    #[test]
    fn a_full_pool_drops_the_buffer_given_back_longest_ago() {
        let mut pool = F32BufferPool::new(3);
        pool.give(vec![1.0; 200]);
        pool.give(vec![9.0; 70]); // stale: its length is never taken again
        pool.give(vec![2.0; 100]);
        let a = pool.take(200);
        pool.give(a); // kept: [100, 70, 200], 70 given back longest ago
        pool.give(vec![3.0; 300]); // full: the stale one goes
        assert_eq!(pool.kept(), 3);
        assert_eq!(pool.take(70), vec![0.0; 70], "the stale buffer was dropped");
        assert_eq!(pool.take(200), vec![1.0; 200]);
        assert_eq!(pool.take(100), vec![2.0; 100]);
        assert_eq!(pool.take(300), vec![3.0; 300]);
    }
}
