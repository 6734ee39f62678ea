//! Ctrl-C: the first SIGINT asks the trainer to checkpoint and stop after
//! the step in progress; the handler then resets itself, so a second
//! Ctrl-C kills at once (the last checkpoint stays resumable).
//!
//! A signal handler can only reach a static, so the flag is one; the
//! trainer itself takes the flag as an argument (`&AtomicBool`), and
//! tests and embedders pass their own.

use std::sync::atomic::{AtomicBool, Ordering};

static SIGINT_SEEN: AtomicBool = AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    SIGINT_SEEN.store(true, Ordering::SeqCst);
}

/// Installs the handler and returns the flag it sets.
pub fn install() -> &'static AtomicBool {
    // SAFETY: `action` is fully initialized (zeroed, then the handler and
    // flags set) before sigaction reads it; the handler only stores to an
    // atomic, which is async-signal-safe.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_sigint as *const () as libc::sighandler_t;
        action.sa_flags = libc::SA_RESETHAND | libc::SA_RESTART;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGINT, &action, std::ptr::null_mut());
    }
    &SIGINT_SEEN
}
