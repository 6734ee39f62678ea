//! Ctrl-C, and SIGTERM (what Slurm, Kubernetes and systemd send before
//! they kill): the first asks the trainer to checkpoint and stop after the
//! step in progress; the handler then resets itself, so a second signal
//! kills at once (the last checkpoint stays resumable).
//!
//! A signal handler can only reach a static, so the flag is one; the
//! trainer itself takes the flag as an argument (`&AtomicBool`), and
//! tests and embedders pass their own.

use std::sync::atomic::{AtomicBool, Ordering};

static STOP_ASKED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(_: libc::c_int) {
    STOP_ASKED.store(true, Ordering::SeqCst);
}

/// Installs the handler for SIGINT and SIGTERM and returns the flag it
/// sets.
pub fn install() -> &'static AtomicBool {
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: `action` is fully initialized (zeroed, then the handler
        // and flags set) before sigaction reads it; the handler only
        // stores to an atomic, which is async-signal-safe.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_stop_signal as *const () as libc::sighandler_t;
            action.sa_flags = libc::SA_RESETHAND | libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
    &STOP_ASKED
}
