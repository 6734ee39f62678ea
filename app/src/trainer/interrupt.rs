//! Ctrl-C, and SIGTERM (what Slurm, Kubernetes and systemd send before
//! they kill): the first asks the trainer to checkpoint and stop after the
//! step in progress; the handler then resets itself, so a second signal
//! kills at once (the last checkpoint stays resumable).
//!
//! A signal handler can only reach a static, so the flag is one; the
//! trainer itself takes the flag as an argument (`&AtomicBool`), and
//! tests and embedders pass their own.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

static STOP_ASKED: AtomicBool = AtomicBool::new(false);
/// The signal that asked, 0 before one did.
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_stop_signal(signal: libc::c_int) {
    STOP_SIGNAL.store(signal, Ordering::SeqCst);
    STOP_ASKED.store(true, Ordering::SeqCst);
}

/// The exit status of a run the installed handler stopped: 128 + the
/// signal's number, as a shell reports a process the signal killed (130
/// for SIGINT, 143 for SIGTERM).
pub fn exit_status() -> u8 {
    match STOP_SIGNAL.load(Ordering::SeqCst) {
        0 => 128 + libc::SIGINT as u8,
        signal => 128 + signal as u8,
    }
}

/// Installs the handler for SIGINT and SIGTERM and returns the flag it
/// sets.
pub fn install() -> &'static AtomicBool {
    crate::sys::on_signals_once(&[libc::SIGINT, libc::SIGTERM], on_stop_signal);
    &STOP_ASKED
}
