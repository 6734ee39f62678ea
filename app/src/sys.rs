//! Every libc call of the `strata` command, each behind a safe function:
//! the rest of the crate calls these and holds no `unsafe` of its own for
//! the OS (the CUDA bench and the SIMD bandwidth sweep keep theirs, in
//! `bench/upload.rs` and `bench/optim.rs`).

use std::path::Path;

/// Free bytes of the file system holding `path` (which must exist), from
/// statvfs; `None` if the call fails.
pub fn file_system_free_bytes(path: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut s = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path and `s` points to writable
    // storage of the struct statvfs fills.
    let rc = unsafe { libc::statvfs(c.as_ptr(), s.as_mut_ptr()) };
    if rc != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it initialized `s`.
    let s = unsafe { s.assume_init() };
    #[allow(clippy::unnecessary_cast)] // u32 on some targets
    Some(s.f_bavail as u64 * s.f_frsize as u64)
}

/// What this process has used so far, every thread: (CPU seconds, user
/// and system; minor page faults), from getrusage; `None` if the call
/// fails.
pub fn process_usage() -> Option<(f64, f64)> {
    // SAFETY: an all-zero rusage is a valid value of the plain C struct.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage only writes the struct it is given, which lives
    // for the call.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return None;
    }
    let secs = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 * 1e-6;
    Some((
        secs(usage.ru_utime) + secs(usage.ru_stime),
        usage.ru_minflt as f64,
    ))
}

/// This process's resident memory now (Linux: /proc/self/statm's resident
/// pages), `None` where the OS does not tell.
pub fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf only reads a configuration value.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    (page > 0).then(|| pages * page as u64)
}

/// The bytes of this process's code (its executable file mappings: the
/// program and its libraries) not yet paged in (Linux: /proc/self/smaps),
/// which running more of it will bring; `None` where the OS does not tell.
pub fn code_not_resident_bytes() -> Option<u64> {
    let smaps = std::fs::read_to_string("/proc/self/smaps").ok()?;
    Some(code_not_resident_in(&smaps))
}

/// [`code_not_resident_bytes`] of an smaps text: for each mapping whose
/// permissions say executable and that maps a file, its Size less its Rss.
fn code_not_resident_in(smaps: &str) -> u64 {
    let (mut total, mut code, mut size) = (0u64, false, 0u64);
    let kib = |line: &str| -> u64 {
        let value = line.split_whitespace().nth(1);
        value.and_then(|v| v.parse().ok()).unwrap_or(0) << 10
    };
    for line in smaps.lines() {
        let mut words = line.split_whitespace();
        let first = words.next().unwrap_or("");
        if first.contains('-') && !first.ends_with(':') {
            // A mapping's header: range, perms, offset, dev, inode, path.
            let perms = words.next().unwrap_or("");
            let path = words.nth(3).unwrap_or("");
            code = perms.contains('x') && path.starts_with('/');
        } else if code && first == "Size:" {
            size = kib(line);
        } else if code && first == "Rss:" {
            total += size.saturating_sub(kib(line));
        }
    }
    total
}

/// This process's peak resident memory so far (Linux: /proc/self/status's
/// VmHWM), `None` where the OS does not tell.
pub fn peak_resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

/// The kernel's clock ticks a second (the unit of /proc/stat), if known.
pub fn clock_ticks_per_second() -> Option<f64> {
    // SAFETY: sysconf only reads a configuration value.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then_some(hz as f64)
}

/// Sends `signal` to the process group `leader` leads (a rank that
/// `strata launch` started, and anything it started); a group already gone
/// is no error (there is nothing left to signal).
pub fn signal_group(leader: u32, signal: libc::c_int) {
    // SAFETY: kill(2) takes any pid and signal number and touches no
    // memory of this process; a negative pid names the process group.
    unsafe {
        libc::kill(-(leader as libc::pid_t), signal);
    }
}

/// Whether this process runs as root (its effective user id is 0).
pub fn is_root() -> bool {
    // SAFETY: geteuid takes no argument, reads no memory of ours and
    // cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Installs `handler` for each of `signals`, reset to the default after
/// its first delivery (so a second signal acts as if none were installed).
/// The handler must be async-signal-safe (store to an atomic, no more).
pub fn on_signals_once(signals: &[libc::c_int], handler: extern "C" fn(libc::c_int)) {
    install_handler(signals, handler, libc::SA_RESETHAND | libc::SA_RESTART);
}

/// Installs `handler` for each of `signals`, for every delivery. The
/// handler must be async-signal-safe (store to an atomic, no more).
pub fn on_signals(signals: &[libc::c_int], handler: extern "C" fn(libc::c_int)) {
    install_handler(signals, handler, libc::SA_RESTART);
}

fn install_handler(signals: &[libc::c_int], handler: extern "C" fn(libc::c_int), flags: i32) {
    for &signal in signals {
        // SAFETY: `action` is fully initialized (zeroed, then the handler
        // and flags set) before sigaction reads it; the caller's handler
        // is async-signal-safe.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = handler as *const () as libc::sighandler_t;
            action.sa_flags = flags;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

/// Makes the process `command` starts get SIGTERM when the thread that
/// started it ends (Linux's parent-death signal), so that a child whose
/// launcher was killed checkpoints and stops instead of running on alone.
pub fn term_with_parent(command: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the child between fork and exec, where
    // only async-signal-safe calls are allowed: prctl is one, and it
    // touches no memory of the parent.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// glibc serves each allocation over 128 KiB (at first) with its own mmap
/// and hands freed memory at the top of a heap back to the kernel, so the
/// buffers a training step frees and allocates again every step come back
/// as fresh pages, each a page fault and a page clear: 1 000–1 300 a step
/// in `strata train`'s default run, a sixth of its CPU time in the kernel.
/// Allocations come from the heap instead (up to 32 MiB, glibc's largest
/// threshold, and beyond it too, with mmap turned off: a model's logits,
/// (tokens, vocabulary) floats, pass 32 MiB at a few hundred tokens), and
/// free heap is kept for reuse, never trimmed: the process keeps the most
/// heap a step has used. (Process-wide, so the
/// binary sets it, not the library: an embedding program may do the
/// same.) The host tier's and devices' large aligned buffers are mappings
/// of their own, made without malloc, so this leaves them as they are.
/// Call it first thing in `main`, before any other thread exists.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
pub fn keep_freed_memory_in_the_heap() {
    // SAFETY: mallopt only changes malloc's parameters, and runs before
    // any other thread exists (the caller's contract); a value it refuses
    // leaves the default in place.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
        libc::mallopt(libc::M_MMAP_MAX, 0);
        // Never trim: a language model's step frees its saved activations
        // at its end (2.4 GB at moe-s's 8192 tokens) and takes as much
        // again at the next; trimmed back to a threshold, every page
        // faulted anew each step (66 000 faults a step for the small
        // preset at 64 × 512 tokens with a 256 MiB threshold, 440 without).
        libc::mallopt(libc::M_TRIM_THRESHOLD, -1);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
pub fn keep_freed_memory_in_the_heap() {}

#[cfg(test)]
mod tests {
    #[test]
    fn code_not_resident_is_each_executable_file_mapping_s_size_less_its_rss() {
        let smaps = "\
55d4-55d5 r-xp 00393000 fe:00 5319661    /work/strata
Size:               8076 kB
Rss:                5236 kB
55d6-55d7 rw-p 00000000 00:00 0          [heap]
Size:              80000 kB
Rss:               72080 kB
7fe6-7fe7 r-xp 00026000 fe:00 326279     /usr/lib/libc.so.6
Size:               1368 kB
Rss:                1176 kB
7ffd-7ffe r-xp 00000000 00:00 0          [vdso]
Size:                  8 kB
Rss:                   4 kB
";
        let kib = (8076 - 5236) + (1368 - 1176);
        assert_eq!(super::code_not_resident_in(smaps), kib << 10);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn resident_memory_grows_with_what_is_touched() {
        let before = super::resident_bytes().expect("Linux reports resident pages");
        let touched = vec![1u8; 64 << 20];
        let after = super::resident_bytes().expect("Linux reports resident pages");
        assert!(after >= before + (48 << 20), "{before} then {after} bytes");
        drop(std::hint::black_box(touched));
    }
}
