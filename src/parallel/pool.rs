//! [`WorkerPool`]: parked threads that run the pieces of a computation
//! `run_all` hands out, so a split costs a wake-up rather than a thread
//! spawn and join (tens of microseconds each, paid in turn by the calling
//! thread for every piece).
//!
//! Workers sleep on a condition variable when the queue has stayed empty
//! for [`POLL`], and a caller that waits for its pieces runs queued pieces
//! itself (its own, or another caller's), then polls as long for the
//! others' end before it sleeps: so no thread spins for longer than that,
//! a pool without workers (one core) still finishes every call, and a
//! piece that splits again cannot deadlock the pool. The queue holds only the pieces of calls still
//! waiting: each call queues fewer pieces than it was given jobs (the
//! splitters give at most one a core) and returns only once they have run.

use std::any::Any;
use std::collections::VecDeque;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};

/// A queued piece, its borrows erased (see `run_all`'s SAFETY note).
type Task = Box<dyn FnOnce() + Send + 'static>;

/// How long a worker out of pieces, or a caller whose pieces still run,
/// polls before it sleeps. A step's splits follow one another tens of
/// microseconds apart, and waking a sleeping thread takes about as long
/// (a futex wake and a reschedule: measured on the 2-core development
/// machine, a split of small's expert GEMM ran slower on two threads than
/// on one), so a thread that polls this long catches the next piece, or
/// its pieces' end, at once; between steps it sleeps.
const POLL: std::time::Duration = std::time::Duration::from_micros(50);

/// Polls `ready` until it holds or [`POLL`] has passed; whether it held.
fn poll_briefly(mut ready: impl FnMut() -> bool) -> bool {
    let t0 = std::time::Instant::now();
    loop {
        if ready() {
            return true;
        }
        if t0.elapsed() >= POLL {
            return false;
        }
        for _ in 0..64 {
            std::hint::spin_loop();
        }
    }
}

/// Parked threads and the queue they take pieces from.
pub(crate) struct WorkerPool {
    queue: Mutex<VecDeque<Task>>,
    queued: Condvar,
}

/// Counts a call's pieces still running; keeps the first panic.
pub(crate) struct Latch {
    state: Mutex<(usize, Option<Box<dyn Any + Send>>)>,
    ended: Condvar,
}

impl Latch {
    /// A latch for `pieces` pieces.
    pub(crate) fn new(pieces: usize) -> Self {
        Latch {
            state: Mutex::new((pieces, None)),
            ended: Condvar::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, (usize, Option<Box<dyn Any + Send>>)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Blocks until every piece has finished.
    pub(crate) fn wait(&self) {
        let mut state = self.lock();
        while state.0 > 0 {
            state = self.ended.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Counts one piece finished, keeping `panic` if it is the first.
    pub(crate) fn finish(&self, panic: Option<Box<dyn Any + Send>>) {
        let mut state = self.lock();
        state.0 -= 1;
        if state.1.is_none() {
            state.1 = panic;
        }
        if state.0 == 0 {
            self.ended.notify_all();
        }
    }
}

impl WorkerPool {
    /// The process's pool: `configured_compute_threads() - 1` workers (the caller is the
    /// other), started on first use. It holds threads only: no state that
    /// a result could depend on.
    pub(crate) fn global() -> &'static WorkerPool {
        static POOL: OnceLock<&'static WorkerPool> = OnceLock::new();
        POOL.get_or_init(|| {
            let pool: &'static WorkerPool = Box::leak(Box::new(WorkerPool {
                queue: Mutex::new(VecDeque::new()),
                queued: Condvar::new(),
            }));
            for i in 1..super::configured_compute_threads() {
                // A worker that cannot be started leaves its pieces to the
                // callers, which run queued pieces while they wait.
                let _ = std::thread::Builder::new()
                    .name(format!("strata-worker-{i}"))
                    .spawn(move || pool.work());
            }
            pool
        })
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<Task>> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn work(&self) {
        loop {
            let mut polled = None;
            poll_briefly(|| {
                polled = self.lock().pop_front();
                polled.is_some()
            });
            let task = match polled {
                Some(task) => task,
                None => {
                    let mut queue = self.lock();
                    loop {
                        if let Some(task) = queue.pop_front() {
                            break task;
                        }
                        queue = self.queued.wait(queue).unwrap_or_else(|e| e.into_inner());
                    }
                }
            };
            task(); // catches its own panic (see `run_all`)
        }
    }

    /// Runs every job, the first on this thread and the others on the
    /// workers (or on this thread, if it finds them still queued); returns
    /// when all have ended, re-raising the first panic among them.
    pub(crate) fn run_all<F: FnOnce() + Send>(&self, jobs: Vec<F>) {
        let mut jobs = jobs.into_iter();
        let Some(first) = jobs.next() else {
            return;
        };
        let latch = Latch::new(jobs.len());
        let queued = jobs.len();
        {
            let mut queue = self.lock();
            for job in jobs {
                let latch = &latch;
                let task: Box<dyn FnOnce() + Send + '_> = Box::new(move || {
                    latch.finish(catch_unwind(AssertUnwindSafe(job)).err());
                });
                // SAFETY: the task borrows `latch` and what `job` captures,
                // all of which outlive this call, and this call returns only
                // once the latch has counted every task finished: the wait
                // below runs whatever the first job does (its panic is
                // caught), and every queued task is run, never dropped
                // unrun (workers and waiting callers run all they pop; a
                // task's panic is caught inside it; the pool is never
                // dropped). So no task runs after the borrows end.
                let task: Task = unsafe { std::mem::transmute(task) };
                queue.push_back(task);
            }
        }
        for _ in 0..queued {
            self.queued.notify_one();
        }
        let first_panic = catch_unwind(AssertUnwindSafe(first)).err();
        loop {
            if latch.lock().0 == 0 {
                break;
            }
            // Help while waiting: the pieces still queued may be ours.
            let task = self.lock().pop_front();
            match task {
                Some(task) => task(),
                None => {
                    poll_briefly(|| latch.lock().0 == 0);
                    latch.wait();
                    break;
                }
            }
        }
        let panic = first_panic.or_else(|| latch.lock().1.take());
        if let Some(panic) = panic {
            resume_unwind(panic);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn every_job_runs_once_including_nested_splits() {
        let pool = WorkerPool::global();
        let mut hits = vec![0u32; 9];
        pool.run_all(hits.iter_mut().map(|h| move || *h += 1).collect());
        assert_eq!(hits, vec![1; 9]);
        // Pieces that split again, from several callers at once: every
        // inner piece runs once and nothing deadlocks, however few workers.
        let total = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| {
                    let outer: Vec<_> = (0..4)
                        .map(|_| {
                            || {
                                let inner: Vec<_> = (0..5)
                                    .map(|_| {
                                        || {
                                            total.fetch_add(1, Ordering::Relaxed);
                                        }
                                    })
                                    .collect();
                                pool.run_all(inner);
                            }
                        })
                        .collect();
                    pool.run_all(outer);
                });
            }
        });
        assert_eq!(total.load(Ordering::Relaxed), 3 * 4 * 5);
    }

    #[test]
    fn a_panic_in_any_job_reaches_the_caller_after_all_have_ended() {
        let pool = WorkerPool::global();
        for bad in [0usize, 3] {
            let ran = AtomicUsize::new(0);
            let result = catch_unwind(AssertUnwindSafe(|| {
                pool.run_all(
                    (0..6)
                        .map(|i| {
                            let ran = &ran;
                            move || {
                                std::thread::sleep(std::time::Duration::from_millis(2));
                                ran.fetch_add(1, Ordering::Relaxed);
                                assert!(i != bad, "job {i} fails");
                            }
                        })
                        .collect(),
                )
            }));
            let message = result.unwrap_err();
            let text = message
                .downcast_ref::<String>()
                .map(String::as_str)
                .unwrap_or_default();
            assert!(text.contains(&format!("job {bad} fails")), "{text}");
            assert_eq!(ran.load(Ordering::Relaxed), 6, "all jobs ended first");
        }
    }
}
