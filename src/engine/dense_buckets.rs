//! The dense gradient all-reduced in buckets while the backward goes on.
//!
//! The backward passes the dense tensors last layer first, and the network
//! says when a range of the gradient holds its sum for the step
//! ([`ExpertRunner::dense_grad_final`]: the last micro-batch's backward has
//! passed it). [`DenseBuckets`] gathers such ranges into buckets of at
//! least `EngineConfig::dense_bucket_bytes` and hands each, copied, to a
//! reducer thread that all-reduces it over a second endpoint of the ranks
//! (so that its collectives never meet the backward's all-to-alls on one
//! endpoint) while this device's backward computes the layers below. After the
//! backward, what was never said final goes too, and the sums are written
//! back. Each element is still summed rank 0 first, then 1, …, so the
//! gradient is the bits of one all-reduce after the backward, whatever
//! the buckets.
//!
//! Every rank makes the same buckets in the same order (the same network
//! says the same ranges final at the same points), which is what the
//! reducer's collectives need. A step that fails stops sending: its
//! reducer ends after the collective it is in, and a peer's reducer
//! waiting for it learns that its endpoint stopped. Nothing waits for the
//! reducer on that path, so a failed step never waits on it.
//!
//! Each step's reducer runs on a [`ReducerThread`] kept for the engine's
//! life, one a device: a thread spawned each step took whichever
//! allocator arena an exited thread had left, as the device threads did
//! (`device_threads.rs`), and four cpu devices peaked 40 MiB higher
//! (docs/performance.md, "The plan against the peak").
//!
//! [`ExpertRunner::dense_grad_final`]: crate::model::ExpertRunner::dense_grad_final

use std::ops::Range;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};

use crate::comm::{Comm, CommError, ModeledLink};
use crate::EngineError;

/// A bucket crosses in pieces of at most this many values (4 MiB), so
/// that an all-to-all of the backward, on the critical path, waits behind
/// one piece on the rank's link rather than behind a whole bucket (an
/// untied head alone is vocabulary × d_model values).
const PIECE_VALUES: usize = 1 << 20;

/// A range of the dense gradient and its values, on their way to the
/// reducer or back from it, summed.
struct Bucket {
    range: Range<usize>,
    values: Vec<f32>,
}

/// A step's reducer, run on a [`ReducerThread`].
type Job = Box<dyn FnOnce() + Send + 'static>;

/// A thread that runs one device's reducers, step after step: started at
/// its first step, ended when it is dropped (after the job it is in, if
/// any; nothing joins it, as nothing waits for a failed step's reducer).
pub(crate) struct ReducerThread {
    name: String,
    jobs: Mutex<Option<Sender<Job>>>,
}

impl ReducerThread {
    pub fn new(name: String) -> Self {
        Self {
            name,
            jobs: Mutex::new(None),
        }
    }

    /// Hands `job` to the thread, starting it where it is not running.
    fn run(&self, job: Job) -> Result<(), EngineError> {
        let mut jobs = self.jobs.lock().unwrap_or_else(|e| e.into_inner());
        let sender = match &*jobs {
            Some(sender) => sender,
            None => {
                let (sender, queue) = unbounded::<Job>();
                std::thread::Builder::new()
                    .name(self.name.clone())
                    .spawn(move || {
                        // A job's panic reaches its step through the
                        // channels it drops; the thread goes on.
                        for job in queue {
                            let _ = catch_unwind(AssertUnwindSafe(job));
                        }
                    })
                    .map_err(|e| {
                        EngineError::Config(format!(
                            "the dense gradient's reducer could not start: {e}"
                        ))
                    })?;
                jobs.insert(sender)
            }
        };
        // The thread ends only when the sender goes, which is here.
        sender.send(job).map_err(|_| {
            EngineError::Config("the dense gradient's reducer thread has ended".into())
        })
    }
}

/// The device thread's side: gathers final ranges into buckets and sends
/// them to the reducer.
pub(crate) struct DenseBuckets {
    to_reducer: Sender<Bucket>,
    from_reducer: Receiver<Result<Bucket, CommError>>,
    /// The reducer's endpoint, given back when its buckets end.
    endpoint_back: Receiver<Box<dyn Comm>>,
    /// Said final and contiguous, not yet sent.
    pending: Option<Range<usize>>,
    /// Sent to the reducer, in order.
    sent: Vec<Range<usize>>,
    len: usize,
    /// Ranges said final are held until they add up to this many bytes.
    min_bytes: usize,
    /// This rank, as errors name it.
    rank: usize,
}

impl DenseBuckets {
    /// A reducer on `thread` over `endpoint` (this rank's second one),
    /// over the same modeled link as `main`, for a gradient of `len`
    /// values sent in buckets of at least `min_bytes`.
    pub fn start<C: Comm>(
        thread: &ReducerThread,
        endpoint: Box<dyn Comm>,
        main: &ModeledLink<C>,
        len: usize,
        min_bytes: usize,
    ) -> Result<Self, EngineError> {
        let link = ModeledLink::sharing(endpoint, main);
        // Unbounded, yet bounded by the step: at most one bucket a range of
        // the gradient each way.
        let (to_reducer, buckets) = unbounded();
        let (done, from_reducer) = unbounded();
        let (give_back, endpoint_back) = bounded(1);
        thread.run(Box::new(move || {
            let _ = give_back.send(reduce_buckets(link, buckets, done));
        }))?;
        Ok(Self {
            to_reducer,
            from_reducer,
            endpoint_back,
            pending: None,
            sent: Vec::new(),
            len,
            min_bytes,
            rank: main.rank(),
        })
    }

    /// `range` of `grad` holds its sum for the step: joined to the ranges
    /// before it where they meet, sent once the bucket is large enough.
    pub fn final_range(&mut self, grad: &[f32], range: Range<usize>) {
        if range.is_empty() || range.end > grad.len().min(self.len) {
            return;
        }
        let merged = match self.pending.take() {
            Some(p) if p.start == range.end => range.start..p.end,
            Some(p) => {
                self.send(grad, p);
                range
            }
            None => range,
        };
        if merged.len() * 4 >= self.min_bytes {
            self.send(grad, merged);
        } else {
            self.pending = Some(merged);
        }
    }

    fn send(&mut self, grad: &[f32], range: Range<usize>) {
        let values = grad[range.clone()].to_vec();
        self.sent.push(range.clone());
        // A reducer that stopped has said why on `from_reducer`; `finish`
        // reads it there.
        let _ = self.to_reducer.send(Bucket { range, values });
    }

    /// Sends what is left (the pending bucket, then every range never said
    /// final, last first), waits for every sum and writes it into `grad`.
    /// Returns the reducer's endpoint for the next step and the time this
    /// thread waited.
    pub fn finish(mut self, grad: &mut [f32]) -> Result<(Box<dyn Comm>, Duration), EngineError> {
        let start = Instant::now();
        if let Some(p) = self.pending.take() {
            self.send(grad, p);
        }
        for range in unsent(&self.sent, self.len).into_iter().rev() {
            self.send(grad, range);
        }
        let Self {
            to_reducer,
            from_reducer,
            endpoint_back,
            sent,
            rank,
            ..
        } = self;
        drop(to_reducer);
        for _ in 0..sent.len() {
            let bucket = from_reducer.recv().map_err(|_| EngineError::Device {
                device: rank,
                why: "the dense gradient's reducer thread stopped".into(),
            })??;
            grad[bucket.range].copy_from_slice(&bucket.values);
        }
        let endpoint = endpoint_back.recv().map_err(|_| EngineError::Device {
            device: rank,
            why: "the dense gradient's reducer panicked".into(),
        })?;
        Ok((endpoint, start.elapsed()))
    }
}

/// The reducer thread: all-reduces each bucket in the order it came, a
/// piece at a time, and sends it back, until the buckets end or a
/// collective fails; returns its endpoint.
fn reduce_buckets(
    mut link: ModeledLink<Box<dyn Comm>>,
    buckets: Receiver<Bucket>,
    done: Sender<Result<Bucket, CommError>>,
) -> Box<dyn Comm> {
    for mut bucket in buckets {
        let summed = bucket
            .values
            .chunks_mut(PIECE_VALUES)
            .try_for_each(|piece| link.all_reduce_sum(piece))
            .map(|()| bucket);
        let failed = summed.is_err();
        if done.send(summed).is_err() || failed {
            break;
        }
    }
    link.into_inner()
}

/// The parts of `0..len` that no range of `sent` covers, ascending.
fn unsent(sent: &[Range<usize>], len: usize) -> Vec<Range<usize>> {
    let mut covered = sent.to_vec();
    covered.sort_by_key(|r| r.start);
    let mut gaps = Vec::new();
    let mut at = 0;
    for r in covered {
        if r.start > at {
            gaps.push(at..r.start);
        }
        at = at.max(r.end);
    }
    if at < len {
        gaps.push(at..len);
    }
    gaps
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::InProcessComm;

    #[test]
    fn the_unsent_ranges_are_the_gaps_between_the_sent() {
        assert_eq!(unsent(&[], 10), vec![0..10]);
        assert_eq!(unsent(&[6..10, 0..2], 10), vec![2..6]);
        assert_eq!(unsent(&[3..5, 4..8], 9), vec![0..3, 8..9]);
        assert_eq!(unsent(&[0..4, 4..10], 10), Vec::<Range<usize>>::new());
    }

    /// Ranges said final are sent as soon as they, joined to the
    /// contiguous ranges said before them, reach the bucket size; a range
    /// that does not meet the pending one sends it; an empty range, or one
    /// past the gradient, is not a range of it. (A rank of its own: what is
    /// sent is what the reducer would sum while the backward goes on.)
    #[test]
    fn final_ranges_join_into_buckets_sent_once_large_enough() {
        let mut ends = InProcessComm::endpoints(1);
        let main = ModeledLink::new(ends.pop().unwrap(), None);
        let second = InProcessComm::endpoints(1).pop().unwrap();
        let len = 16;
        let thread = ReducerThread::new("test-reduce".into());
        let mut buckets = DenseBuckets::start(&thread, Box::new(second), &main, len, 32).unwrap();
        let mut g: Vec<f32> = (0..len).map(|i| i as f32).collect();
        buckets.final_range(&g, 12..16); // 16 bytes: held
        assert!(buckets.sent.is_empty());
        assert_eq!(buckets.pending, Some(12..16));
        buckets.final_range(&g, 8..12); // joined: 32 bytes, sent
        assert_eq!(buckets.sent, vec![8..16]);
        assert_eq!(buckets.pending, None);
        buckets.final_range(&g, 4..8); // held
        buckets.final_range(&g, 6..6);
        buckets.final_range(&g, 10..17);
        assert_eq!(buckets.pending, Some(4..8), "nothing of the gradient");
        buckets.final_range(&g, 2..3); // does not meet 4..8: sends it
        buckets.final_range(&g, 0..1); // nor 2..3
        assert_eq!(buckets.sent, vec![8..16, 4..8, 2..3]);
        assert_eq!(buckets.pending, Some(0..1));
        let want = g.clone(); // one rank: the sum is its own
        buckets.finish(&mut g).unwrap();
        assert_eq!(g, want);
    }

    /// Two ranks say ranges final in a given order, with values changed
    /// after each says so only outside what it said; every rank ends with
    /// the sum of both ranks' final values, in rank order.
    fn reduce_in_buckets(len: usize, said: &[Range<usize>], min_bytes: usize) -> Vec<Vec<f32>> {
        let grads: Vec<Vec<f32>> = (0..2)
            .map(|r| (0..len).map(|i| (i * 7 + r * 3) as f32 * 0.25).collect())
            .collect();
        let mains = InProcessComm::endpoints(2);
        let seconds = InProcessComm::endpoints(2);
        std::thread::scope(|s| {
            let handles: Vec<_> = mains
                .into_iter()
                .zip(seconds)
                .zip(&grads)
                .map(|((main, second), grad)| {
                    s.spawn(move || {
                        let main = ModeledLink::new(main, None);
                        let thread = ReducerThread::new("test-reduce".into());
                        let mut buckets =
                            DenseBuckets::start(&thread, Box::new(second), &main, len, min_bytes)
                                .unwrap();
                        let mut g = vec![f32::NAN; len];
                        for r in said {
                            g[r.clone()].copy_from_slice(&grad[r.clone()]);
                            buckets.final_range(&g, r.clone());
                        }
                        for (i, v) in g.iter_mut().enumerate() {
                            if v.is_nan() {
                                *v = grad[i];
                            }
                        }
                        buckets.finish(&mut g).unwrap();
                        g
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn buckets_give_the_sum_of_every_rank_whatever_was_said_final() {
        let q = 1000;
        let len = 3 * q + 17;
        let want: Vec<f32> = (0..len)
            .map(|i| (i * 7) as f32 * 0.25 + (i * 7 + 3) as f32 * 0.25)
            .collect();
        // Nothing said; the last layers first, contiguous (small ranges
        // joined into one bucket, large ones sent alone); out of order.
        let cases: Vec<Vec<Range<usize>>> = vec![
            vec![],
            vec![len - 10..len, len - 20..len - 10, q..len - 20],
            vec![2 * q..len, q..2 * q, 5..q],
            vec![0..3, len - 4..len, q..q + 1],
        ];
        // Buckets of one range each, of about a layer, of the whole.
        for min_bytes in [0, 4 * q, 4 * len] {
            for said in &cases {
                for g in reduce_in_buckets(len, said, min_bytes) {
                    assert!(g == want, "{said:?} in buckets of {min_bytes} bytes");
                }
            }
        }
    }

    #[test]
    fn a_bucket_longer_than_a_piece_is_summed_whole() {
        let len = 2 * PIECE_VALUES + 5;
        let want: Vec<f32> = (0..len)
            .map(|i| (i * 7) as f32 * 0.25 + (i * 7 + 3) as f32 * 0.25)
            .collect();
        for g in reduce_in_buckets(len, &[7..len, 0..7], 0) {
            assert!(g == want);
        }
    }

    /// Step after step, a device's reducers run on one thread, which a
    /// reducer's panic does not end.
    #[test]
    fn a_reducer_thread_runs_every_step_s_reducer() {
        let thread = ReducerThread::new("test-kept".into());
        let (tx, rx) = unbounded();
        for step in 0..3 {
            let tx = tx.clone();
            thread
                .run(Box::new(move || {
                    tx.send(std::thread::current().id()).unwrap();
                    assert!(step != 1, "a reducer that panics");
                }))
                .unwrap();
        }
        let ids: Vec<_> = (0..3).map(|_| rx.recv().unwrap()).collect();
        assert!(ids.iter().all(|&id| id == ids[0]), "{ids:?}");
        assert_ne!(ids[0], std::thread::current().id());
        // Every step's buckets through it, on one rank.
        let main = ModeledLink::new(InProcessComm::endpoints(1).pop().unwrap(), None);
        let mut endpoint: Box<dyn Comm> = Box::new(InProcessComm::endpoints(1).pop().unwrap());
        for _ in 0..3 {
            let mut buckets = DenseBuckets::start(&thread, endpoint, &main, 4, 0).unwrap();
            let mut g = vec![2.0f32; 4];
            buckets.final_range(&g, 0..4);
            let (back, _) = buckets.finish(&mut g).unwrap();
            assert_eq!(g, vec![2.0; 4]);
            endpoint = back;
        }
    }

    #[test]
    fn a_rank_that_stops_ends_its_peer_s_reduction_with_an_error() {
        let mut mains = InProcessComm::endpoints(2);
        let mut seconds = InProcessComm::endpoints(2);
        let (main1, second1) = (mains.pop().unwrap(), seconds.pop().unwrap());
        let (main0, second0) = (mains.pop().unwrap(), seconds.pop().unwrap());
        let stopped = std::thread::spawn(move || {
            let main = ModeledLink::new(main1, None);
            let thread = ReducerThread::new("test-reduce-1".into());
            let buckets = DenseBuckets::start(&thread, Box::new(second1), &main, 8, 0).unwrap();
            drop(buckets); // its step failed before the backward's end
        });
        let main = ModeledLink::new(main0, None);
        let thread = ReducerThread::new("test-reduce-0".into());
        let buckets = DenseBuckets::start(&thread, Box::new(second0), &main, 8, 0).unwrap();
        let mut g = vec![1.0f32; 8];
        let Err(err) = buckets.finish(&mut g) else {
            panic!("a reduction without its peer succeeded");
        };
        assert!(
            matches!(err, EngineError::Comm(CommError::PeerStopped { peer: 1 })),
            "{err}"
        );
        stopped.join().unwrap();
    }
}
