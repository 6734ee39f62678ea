use clap::Parser;

fn main() -> std::process::ExitCode {
    keep_freed_memory_in_the_heap();
    strata_cli::cli::run(strata_cli::cli::Cli::parse())
}

/// glibc serves each allocation over 128 KiB (at first) with its own mmap
/// and hands freed memory at the top of a heap back to the kernel, so the
/// buffers a training step frees and allocates again every step come back
/// as fresh pages, each a page fault and a page clear: 1 000–1 300 a step
/// in `strata train`'s default run, a sixth of its CPU time in the kernel.
/// Allocations come from the heap instead (up to 32 MiB, glibc's largest
/// threshold, and beyond it too, with mmap turned off: a model's logits,
/// (tokens, vocabulary) floats, pass 32 MiB at a few hundred tokens), and
/// up to 256 MiB of free heap is kept for reuse. (Process-wide, so the
/// binary sets it, not the library: an embedding program may do the
/// same.) The host tier's and devices' large aligned buffers are mappings
/// of their own, made without malloc, so this leaves them as they are.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_freed_memory_in_the_heap() {
    // SAFETY: mallopt only changes malloc's parameters, and runs here
    // before any other thread exists; a value it refuses leaves the
    // default in place.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_MMAP_MAX, 0);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 256 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_freed_memory_in_the_heap() {}
