//! The tier crate's calls into the C library: anonymous mappings at huge-page
//! boundaries for large host buffers, and the memlock limit that a refused
//! page-lock is explained with. The crate's other `unsafe` is its own
//! memory protocol or the CUDA driver (docs/design.md lists each).

use std::ptr::NonNull;

/// Maps `len` zeroed bytes (a multiple of 4096) at an `align` boundary (a
/// power of two, 2 MiB for huge pages) and asks the kernel to back them
/// with transparent huge pages. On a virtual machine, memory reached
/// through 4 KiB pages pays two-level page walks on every TLB miss, for the
/// CPU and for the host's disk DMA alike. `None` if the mapping fails; a
/// refused `madvise` (THP off) leaves plain pages.
pub(crate) fn map_huge(len: usize, align: usize) -> Option<NonNull<u8>> {
    let span = len + align;
    // SAFETY: an anonymous private mapping at an address of the kernel's
    // choosing touches no existing memory.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return None;
    }
    let start = raw as usize;
    let aligned = start.next_multiple_of(align);
    let head = aligned - start;
    let tail = span - head - len;
    // SAFETY: [start, aligned) and [aligned + len, start + span) lie inside
    // the mapping just made and outside the part kept.
    unsafe {
        if head > 0 {
            libc::munmap(raw, head);
        }
        if tail > 0 {
            libc::munmap((aligned + len) as *mut libc::c_void, tail);
        }
        libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
    NonNull::new(aligned as *mut u8)
}

/// Unmaps what `map_huge` mapped.
///
/// # Safety
/// `[ptr, ptr + len)` is exactly one `map_huge` mapping, unmapped once, and
/// nothing refers to it any more.
pub(crate) unsafe fn unmap(ptr: NonNull<u8>, len: usize) {
    // SAFETY: the caller's contract.
    unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
}

/// This process's memlock limit, for a message: "unlimited", "N bytes",
/// or "unknown".
pub(crate) fn memlock_limit() -> String {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    let known = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } == 0;
    if !known {
        "unknown".to_string()
    } else if limit.rlim_cur == libc::RLIM_INFINITY {
        "unlimited".to_string()
    } else {
        format!("{} bytes", limit.rlim_cur)
    }
}
