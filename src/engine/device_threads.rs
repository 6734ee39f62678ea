//! The threads several devices in one process compute their shares of a
//! step on: one a device, started at its first step and kept for the
//! engine's life, so that device i computes on the same thread at every
//! step.
//!
//! A thread spawned afresh each step takes whichever allocator arena an
//! exited thread left behind (glibc hands a freed arena to the next new
//! thread), and strata's binary never trims the heap: each arena then
//! came to hold the peak of every device that had used it, and two cpu
//! devices peaked at 183–214 MiB where the plan counted 146 (small,
//! docs/performance.md, "The plan against the peak"). A device kept on
//! its thread keeps its arena, which holds its own peak alone.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Mutex;
use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Sender};

use crate::parallel::Latch;
use crate::EngineError;

/// A device's share, its borrows erased (see `run`'s SAFETY note).
type Task = Box<dyn FnOnce() + Send + 'static>;

/// One thread a device, started as the devices first need them.
#[derive(Default)]
pub(super) struct DeviceThreads {
    threads: Vec<DeviceThread>,
}

struct DeviceThread {
    /// Tasks for the thread; dropped first, which ends it.
    tasks: Option<Sender<Task>>,
    handle: Option<JoinHandle<()>>,
}

/// Why a device's share has no result.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum ShareFailed {
    /// Its thread could not be started (the OS's reason).
    NotStarted(String),
    /// The share panicked.
    Panicked,
}

impl ShareFailed {
    /// The engine's error for device `device`'s share.
    pub fn of_device(self, device: usize) -> EngineError {
        let why = match self {
            ShareFailed::Panicked => "its thread panicked".into(),
            ShareFailed::NotStarted(e) => format!("its thread could not start: {e}"),
        };
        EngineError::Device { device, why }
    }
}

/// Held by a share's task: counts it ended as the task is dropped, after
/// it has run or, never run, with it.
struct Ended<'a>(&'a Latch);

impl Drop for Ended<'_> {
    fn drop(&mut self) {
        self.0.finish(None); // a share's panic is kept in its result
    }
}

impl DeviceThreads {
    /// Runs `shares[i]` on device i's thread (started now if it is not
    /// yet) and returns each share's result, once every share has ended.
    pub fn run<R, F>(&mut self, shares: Vec<F>) -> Vec<Result<R, ShareFailed>>
    where
        R: Send,
        F: FnOnce() -> R + Send,
    {
        let n = shares.len();
        let started: Vec<Result<(), ShareFailed>> = (0..n).map(|i| self.start(i)).collect();
        let results: Vec<Mutex<Option<std::thread::Result<R>>>> =
            (0..n).map(|_| Mutex::new(None)).collect();
        let latch = Latch::new(n);
        for (i, share) in shares.into_iter().enumerate() {
            let (slot, ended) = (&results[i], Ended(&latch));
            let task: Box<dyn FnOnce() + Send + '_> = Box::new(move || {
                let result = catch_unwind(AssertUnwindSafe(share));
                *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
                drop(ended);
            });
            // SAFETY: the task borrows `latch`, `results[i]` and what the
            // share captures, all of which outlive this call, and this
            // call returns only once the latch has counted every task
            // ended: a task counts itself ended when it is dropped, which
            // its thread does right after running it (a share's panic is
            // caught inside it), and a task that is never sent (its
            // thread did not start) or whose thread is gone (the send
            // fails and hands it back) is dropped here unrun. The thread
            // holds no task past that drop. So no task runs, or is
            // dropped, after the borrows end.
            let task: Task = unsafe { std::mem::transmute(task) };
            let thread = self.threads.get(i).and_then(|t| t.tasks.as_ref());
            match (&started[i], thread) {
                (Ok(()), Some(tasks)) => drop(tasks.send(task)),
                _ => drop(task),
            }
        }
        latch.wait();
        results
            .into_iter()
            .zip(started)
            .map(|(slot, started)| {
                started?;
                match slot.into_inner().unwrap_or_else(|e| e.into_inner()) {
                    Some(Ok(r)) => Ok(r),
                    Some(Err(_)) => Err(ShareFailed::Panicked),
                    None => Err(ShareFailed::NotStarted("its thread has ended".into())),
                }
            })
            .collect()
    }

    /// Starts device `i`'s thread where it is not running.
    fn start(&mut self, i: usize) -> Result<(), ShareFailed> {
        while self.threads.len() <= i {
            self.threads.push(DeviceThread {
                tasks: None,
                handle: None,
            });
        }
        let thread = &mut self.threads[i];
        if thread.tasks.is_some() {
            return Ok(());
        }
        let (tasks, queue) = unbounded::<Task>();
        let handle = std::thread::Builder::new()
            .name(format!("strata-device-{i}"))
            .spawn(move || {
                // Each task catches its share's panic; the loop ends when
                // the engine drops the sender.
                for task in queue {
                    task();
                }
            })
            .map_err(|e| ShareFailed::NotStarted(e.to_string()))?;
        thread.tasks = Some(tasks);
        thread.handle = Some(handle);
        Ok(())
    }
}

impl Drop for DeviceThreads {
    fn drop(&mut self) {
        // No share runs (`run` returns once they have ended): each thread
        // waits for its next task, and ends as its sender goes.
        for thread in &mut self.threads {
            thread.tasks = None;
        }
        for thread in &mut self.threads {
            if let Some(handle) = thread.handle.take() {
                let _ = handle.join();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn thread_name() -> String {
        std::thread::current()
            .name()
            .unwrap_or_default()
            .to_string()
    }

    #[test]
    fn each_device_s_share_runs_on_its_own_thread_every_time() {
        let mut threads = DeviceThreads::default();
        let mut seen = Vec::new();
        for _ in 0..3 {
            let ids = threads.run(
                (0..3)
                    .map(|i| move || (i, thread_name(), std::thread::current().id()))
                    .collect(),
            );
            let ids: Vec<_> = ids.into_iter().map(Result::unwrap).collect();
            for (i, (share, name, _)) in ids.iter().enumerate() {
                assert_eq!(
                    (*share, name.as_str()),
                    (i, format!("strata-device-{i}").as_str())
                );
            }
            seen.push(ids.into_iter().map(|(_, _, id)| id).collect::<Vec<_>>());
        }
        assert!(seen.windows(2).all(|w| w[0] == w[1]), "{seen:?}");
    }

    #[test]
    fn a_share_that_panics_is_named_after_every_share_has_ended() {
        let mut threads = DeviceThreads::default();
        let ended = std::sync::atomic::AtomicUsize::new(0);
        let shares: Vec<_> = (0..3)
            .map(|i| {
                let ended = &ended;
                move || {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                    ended.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    assert!(i != 1, "share {i} fails");
                    i * 10
                }
            })
            .collect();
        let results = threads.run(shares);
        assert_eq!(ended.load(std::sync::atomic::Ordering::SeqCst), 3);
        assert_eq!(results, vec![Ok(0), Err(ShareFailed::Panicked), Ok(20)]);
        // The thread whose share panicked runs the next one.
        let again = threads.run((0..3).map(|i| move || i).collect());
        assert_eq!(again, vec![Ok(0), Ok(1), Ok(2)]);
    }

    #[test]
    fn shares_borrow_and_change_what_the_caller_holds() {
        let mut threads = DeviceThreads::default();
        let mut counts = vec![0u64; 4];
        let borrowed = vec![5u64; 4];
        let results = threads.run(
            counts
                .iter_mut()
                .zip(&borrowed)
                .map(|(c, b)| move || *c += b)
                .collect(),
        );
        assert!(results.iter().all(Result::is_ok));
        assert_eq!(counts, vec![5; 4]);
    }
}
