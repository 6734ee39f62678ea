//! Independent pieces of one computation run on scoped threads: the first
//! on the calling thread, the others on threads that end with the call.
//! No pool lives between calls (a spawn costs tens of microseconds, so
//! callers split only work far larger than that), and joining blocks
//! rather than spins, so on a machine shared with the optimizer and the
//! I/O the cores go to whoever has work.

/// The cores this process may use, asked once. std answers afresh on
/// every call from the affinity mask and the cgroup quota files (about
/// 40 µs on the development machine), and the GEMMs, attention and
/// activation passes ask before every split: in the default `train` run
/// that was 13 % of the main thread's time. A quota changed while the
/// process runs is not seen; splits only change how work is shared out,
/// never a result.
pub(crate) fn cores() -> usize {
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// Runs every job, the first on this thread and the others on scoped
/// threads; returns when all have ended (a panic in one is re-raised).
pub(crate) fn run_all<F: FnOnce() + Send>(jobs: Vec<F>) {
    std::thread::scope(|s| {
        let mut jobs = jobs.into_iter();
        let first = jobs.next();
        for job in jobs {
            s.spawn(job);
        }
        if let Some(job) = first {
            job();
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_job_runs_once() {
        let mut hits = vec![0u32; 5];
        run_all(hits.iter_mut().map(|h| move || *h += 1).collect());
        assert_eq!(hits, vec![1; 5]);
        run_all(Vec::<fn()>::new());
        assert!(cores() >= 1);
    }
}
