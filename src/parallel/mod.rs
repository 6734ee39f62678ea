//! Independent pieces of one computation: the first on the calling thread,
//! the others on the parked workers of a [`WorkerPool`] (`pool.rs`), which
//! costs a wake-up a piece rather than a thread spawn. Waiting blocks
//! rather than spins (a waiting caller runs queued pieces itself), so on a
//! machine shared with the optimizer and the I/O the cores go to whoever
//! has work.

mod pool;

pub(crate) use pool::{Latch, WorkerPool};

/// The cores this process may use, asked once. std answers afresh on
/// every call from the affinity mask and the cgroup quota files (about
/// 40 µs on the development machine). A quota changed while the process
/// runs is not seen.
pub fn machine_cores() -> usize {
    static MACHINE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MACHINE.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The most compute threads [`set_compute_threads`] takes for each of the
/// machine's cores, as the optimizer's pool does.
pub use strata_optim::MAX_THREADS_PER_CORE;

static COMPUTE_THREADS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// The threads the cpu backend's GEMMs, attention and activation passes
/// split their work over: [`set_compute_threads`]'s count, else
/// [`machine_cores`]. The splits ask before every piece of work, hence
/// the count is fixed once. Splits only change how work is shared out,
/// never a result.
pub fn compute_threads() -> usize {
    if ONE_THREAD.with(std::cell::Cell::get) {
        return 1;
    }
    configured_compute_threads()
}

/// [`compute_threads`] as the process fixed it, whatever the calling
/// thread computes: what the pool sizes itself by.
pub(crate) fn configured_compute_threads() -> usize {
    *COMPUTE_THREADS.get_or_init(machine_cores)
}

thread_local! {
    /// Set while this thread computes one of several pieces side by side
    /// ([`on_one_thread`]).
    static ONE_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `body` with this thread's splits on this thread alone:
/// [`compute_threads`] is 1 within it. For work already split into
/// pieces, one to a thread (the cpu device's experts side by side), whose
/// own GEMMs and passes would only queue pieces for threads that are
/// busy with the other pieces. No result changes: splits never change a
/// bit.
pub(crate) fn on_one_thread<T>(body: impl FnOnce() -> T) -> T {
    /// Restores the thread's flag, also when `body` panics.
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ONE_THREAD.with(|f| f.set(self.0));
        }
    }
    let _restore = Restore(ONE_THREAD.with(|f| f.replace(true)));
    body()
}

/// Fixes, for the rest of the process, how many threads the cpu backend's
/// compute splits over (the caller's and `n - 1` pooled workers), before
/// the first split asks. Fewer than the machine's cores leave the others
/// to the SSD tier's I/O and the optimizer, as a GPU leaves every core;
/// no result changes by a bit. The CUDA backend's kernels do not use
/// them. Refused (with the count in force) once a split has fixed another
/// count, for 0, and past [`MAX_THREADS_PER_CORE`] threads a core (the
/// pool starts its workers at once, and threads beyond the cores only take
/// turns).
///
/// ```
/// // A program that leaves one core to the SSD tier's I/O, first thing:
/// let threads = strata::machine_cores().saturating_sub(1).max(1);
/// strata::set_compute_threads(threads).unwrap();
/// // The count holds for the rest of the process.
/// assert!(strata::set_compute_threads(threads).is_ok());
/// assert!(strata::set_compute_threads(threads + 1).is_err());
/// ```
pub fn set_compute_threads(n: usize) -> Result<(), crate::EngineError> {
    if n == 0 {
        return Err(crate::EngineError::Config(
            "the compute threads must be at least 1".into(),
        ));
    }
    strata_optim::check_thread_count(n)
        .map_err(|e| crate::EngineError::Config(format!("{n} compute threads: {e}")))?;
    let fixed = *COMPUTE_THREADS.get_or_init(|| n);
    if fixed != n {
        return Err(crate::EngineError::Config(format!(
            "the compute threads are already {fixed} in this process (set before the first \
             engine or computation; it cannot change once one has run)"
        )));
    }
    Ok(())
}

/// Runs every job, the first on this thread and the others on the
/// process's worker pool; returns when all have ended (a panic in one is
/// re-raised).
pub(crate) fn run_all<F: FnOnce() + Send>(jobs: Vec<F>) {
    if jobs.len() < 2 {
        jobs.into_iter().for_each(|job| job());
        return;
    }
    WorkerPool::global().run_all(jobs);
}

/// Elements a job should touch at least to be worth a thread of its own:
/// about ten microseconds of streaming work, above what handing a job to
/// a worker of the pool costs while it polls (docs/performance.md, "The
/// pool's smallest job"; 1 << 17 before the pool polled).
pub(crate) const MIN_JOB_WORK: usize = 1 << 14;

/// Rows a job takes when `rows` rows of `work_per_row` elements each are
/// shared out: all on the calling thread when the whole is small, else an
/// even share over the cores.
pub(crate) fn rows_per_job(rows: usize, work_per_row: usize) -> usize {
    let jobs = (rows.saturating_mul(work_per_row) / MIN_JOB_WORK).clamp(1, compute_threads());
    rows.div_ceil(jobs).max(1)
}

/// Runs `body(first_row, block)` over `out` cut into blocks of whole rows
/// (`row_len` elements a row), each block on its own thread. Every row is
/// computed by exactly one job, so a body that writes each of its rows
/// from that row's inputs alone gives the same bits however the rows are
/// cut.
pub(crate) fn for_row_blocks<T: Send>(
    out: &mut [T],
    row_len: usize,
    work_per_row: usize,
    body: impl Fn(usize, &mut [T]) + Sync,
) {
    let rows = out.len() / row_len.max(1);
    let per = rows_per_job(rows, work_per_row);
    let body = &body;
    run_all(
        out.chunks_mut((per * row_len).max(1))
            .enumerate()
            .map(|(i, block)| move || body(i * per, block))
            .collect(),
    );
}

/// `for_row_blocks` over two outputs with the same rows (`row_len` and
/// `row_len2` elements a row), cut alike.
pub(crate) fn for_row_block_pairs<T: Send, U: Send>(
    out: &mut [T],
    row_len: usize,
    out2: &mut [U],
    row_len2: usize,
    work_per_row: usize,
    body: impl Fn(usize, &mut [T], &mut [U]) + Sync,
) {
    let rows = out.len() / row_len.max(1);
    assert_eq!(rows * row_len2, out2.len(), "the two outputs' rows differ");
    let per = rows_per_job(rows, work_per_row);
    let body = &body;
    run_all(
        out.chunks_mut((per * row_len).max(1))
            .zip(out2.chunks_mut((per * row_len2).max(1)))
            .enumerate()
            .map(|(i, (block, block2))| move || body(i * per, block, block2))
            .collect(),
    );
}

/// `buf` zeroed, shared over the cores when it is large.
pub(crate) fn fill_zeros(buf: &mut [f32]) {
    for_row_blocks(buf, 1, 1, |_, part| part.fill(0.0));
}

/// `dst` = `src`, shared over the cores when it is large.
pub(crate) fn copy_into(dst: &mut [f32], src: &[f32]) {
    assert_eq!(dst.len(), src.len());
    for_row_blocks(dst, 1, 1, |first, part| {
        part.copy_from_slice(&src[first..first + part.len()])
    });
}

/// `out` = `a` + `b` element by element (each sum the one `a[i] += b[i]`
/// gives), shared over the cores when it is large.
pub(crate) fn add_into(out: &mut [f32], a: &[f32], b: &[f32]) {
    assert!(out.len() == a.len() && out.len() == b.len());
    for_row_blocks(out, 1, 2, |first, part| {
        let (a, b) = (&a[first..first + part.len()], &b[first..first + part.len()]);
        for ((o, &x), &y) in part.iter_mut().zip(a).zip(b) {
            *o = x + y;
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
        assert!(compute_threads() >= 1);
    }

    #[test]
    fn copy_and_add_write_every_element_as_the_plain_loops_do() {
        // Large enough to be split over two cores or more.
        let n = 4 * MIN_JOB_WORK + 3;
        let a: Vec<f32> = (0..n).map(|i| (i as f32).sin()).collect();
        let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).cos() * 1e-3).collect();
        let mut copied = vec![f32::NAN; n];
        copy_into(&mut copied, &a);
        assert_eq!(copied, a);
        let mut sum = vec![f32::NAN; n];
        add_into(&mut sum, &a, &b);
        let mut want = a.clone();
        want.iter_mut().zip(&b).for_each(|(x, y)| *x += y);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&sum), bits(&want));
    }

    #[test]
    fn row_blocks_cover_every_row_once_in_whole_rows() {
        for rows in [0usize, 1, 7, 1000, 100_000] {
            let mut out = vec![0u32; rows * 3];
            let mut marks = vec![0u8; rows];
            // Enough work per row that large cases split over the cores.
            for_row_block_pairs(&mut out, 3, &mut marks, 1, 64, |first, block, m| {
                assert_eq!(block.len() % 3, 0);
                assert_eq!(block.len() / 3, m.len());
                for (r, row) in block.chunks_mut(3).enumerate() {
                    row.iter_mut().for_each(|v| *v += (first + r) as u32);
                    m[r] += 1;
                }
            });
            assert!(marks.iter().all(|&m| m == 1));
            assert!(out
                .chunks(3)
                .enumerate()
                .all(|(r, row)| row.iter().all(|&v| v == r as u32)));
        }
        assert_eq!(rows_per_job(10, 1), 10); // small: one job
        assert!(rows_per_job(1 << 20, 1 << 10) < 1 << 20 || compute_threads() == 1);
    }
}
