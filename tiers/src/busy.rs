//! [`BusyClock`]: how long at least one I/O call was in flight, over every
//! thread that makes them (the union of their intervals, not the sum), so a
//! step's SSD time can be set against its wall time.

use std::sync::Mutex;
use std::time::{Duration, Instant};

#[derive(Default)]
pub(crate) struct BusyClock {
    inner: Mutex<Busy>,
}

#[derive(Default)]
struct Busy {
    in_flight: u32,
    /// When `in_flight` last rose from 0 (or the last `take` while busy).
    since: Option<Instant>,
    total: Duration,
}

/// Keeps its clock busy until dropped.
pub(crate) struct BusyGuard<'a>(&'a BusyClock);

impl BusyClock {
    fn lock(&self) -> std::sync::MutexGuard<'_, Busy> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn enter(&self) -> BusyGuard<'_> {
        let mut busy = self.lock();
        if busy.in_flight == 0 {
            busy.since = Some(Instant::now());
        }
        busy.in_flight += 1;
        BusyGuard(self)
    }

    /// The busy time since the last `take` (an interval still open counts
    /// up to now), and starts counting afresh.
    pub fn take(&self) -> Duration {
        let mut busy = self.lock();
        let now = Instant::now();
        if let Some(since) = busy.since {
            busy.total += now - since;
            busy.since = Some(now);
        }
        std::mem::take(&mut busy.total)
    }
}

impl Drop for BusyGuard<'_> {
    fn drop(&mut self) {
        let mut busy = self.0.lock();
        busy.in_flight -= 1;
        if busy.in_flight == 0 {
            let since = busy.since.take().expect("an open interval");
            busy.total += since.elapsed();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlapping_calls_count_once_and_take_resets() {
        let clock = BusyClock::default();
        assert_eq!(clock.take(), Duration::ZERO);
        let start = Instant::now();
        let a = clock.enter();
        let b = clock.enter();
        std::thread::sleep(Duration::from_millis(30));
        drop(a);
        drop(b);
        let span = start.elapsed();
        std::thread::sleep(Duration::from_millis(20)); // idle: not counted
        let busy = clock.take();
        // The union of a and b, never their sum (which would pass `span`).
        assert!(busy >= Duration::from_millis(30), "{busy:?}");
        assert!(busy <= span, "{busy:?} > {span:?}");
        assert_eq!(clock.take(), Duration::ZERO);
        // An interval still open counts up to the take, then afresh.
        let open = clock.enter();
        std::thread::sleep(Duration::from_millis(10));
        let rest = Instant::now(); // the rest of `open` lies after this
        assert!(clock.take() >= Duration::from_millis(10));
        drop(open);
        assert!(clock.take() <= rest.elapsed());
    }
}
