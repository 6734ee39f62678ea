//! `strata launch --comm nccl --nproc N -- train …`: the ranks started by
//! strata itself, as torchrun starts them: N processes of this strata,
//! each told its place by `RANK`, `LOCAL_RANK`, `WORLD_SIZE`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR` (127.0.0.1) and `MASTER_PORT` (a free
//! port, or the one the environment gives), from which each joins the
//! others over NCCL (`strata::comm::NcclComm`).
//!
//! The launcher waits for every rank. When one ends on an error, the
//! others are asked to stop (SIGTERM) and, after [`GRACE`], killed: a run
//! whose rank failed ends instead of waiting for it. Its exit status is
//! the first failed rank's, or 0.
//!
//! Signals go through the launcher, as mpirun passes them on: the ranks
//! run in a process group of their own (so a terminal's Ctrl-C reaches the
//! launcher alone), and the first SIGINT or SIGTERM the launcher gets is
//! passed to every rank as one SIGTERM, on which each checkpoints after
//! its step and stops, all at the same step; a second one kills them. A
//! rank whose launcher dies gets SIGTERM too (Linux's parent-death
//! signal), so no rank trains on alone.

use std::ffi::OsString;
use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The stop signals a launcher was sent: how many, and the last.
#[derive(Debug, Default)]
pub struct StopSignals {
    pub count: AtomicUsize,
    pub last: AtomicI32,
}

impl StopSignals {
    pub const fn new() -> Self {
        Self {
            count: AtomicUsize::new(0),
            last: AtomicI32::new(0),
        }
    }
}

static SIGNALS: StopSignals = StopSignals::new();

extern "C" fn on_stop_signal(signal: libc::c_int) {
    SIGNALS.last.store(signal, Ordering::SeqCst);
    SIGNALS.count.fetch_add(1, Ordering::SeqCst);
}

/// Takes SIGINT and SIGTERM for the launcher, every time; what [`run`]
/// reads.
pub fn install() -> &'static StopSignals {
    crate::sys::on_signals(&[libc::SIGINT, libc::SIGTERM], on_stop_signal);
    &SIGNALS
}

/// How long the other ranks have to stop once one has failed.
pub const GRACE: Duration = Duration::from_secs(30);

/// How often the launcher looks at its ranks.
const POLL: Duration = Duration::from_millis(50);

/// The port the ranks meet at: `MASTER_PORT` if set, else a free one.
pub fn master_port() -> Result<u16, String> {
    if let Ok(port) = std::env::var("MASTER_PORT") {
        return port
            .trim()
            .parse()
            .map_err(|_| format!("MASTER_PORT={port:?} is not a port (0–65535)"));
    }
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port on 127.0.0.1 for the ranks to meet at: {e}"))
}

/// Rank `rank` of `nproc`: `strata <command>` with its place in the
/// environment.
pub fn rank_command(
    strata: &Path,
    command: &[OsString],
    rank: usize,
    nproc: usize,
    port: u16,
) -> Command {
    let mut c = Command::new(strata);
    {
        use std::os::unix::process::CommandExt;
        c.process_group(0);
    }
    crate::sys::term_with_parent(&mut c);
    c.args(command)
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", nproc.to_string())
        .env("LOCAL_WORLD_SIZE", nproc.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string());
    c
}

/// Starts every rank and waits for them all. Returns the first failed
/// rank's status, 128 + the signal where `signals` asked the ranks to stop
/// (as a shell reports a process a signal ended), or 0.
pub fn run(
    strata: &Path,
    command: &[OsString],
    nproc: usize,
    port: u16,
    signals: &StopSignals,
) -> Result<i32, String> {
    let mut ranks: Vec<Option<Child>> = Vec::with_capacity(nproc);
    for rank in 0..nproc {
        match rank_command(strata, command, rank, nproc, port).spawn() {
            Ok(child) => ranks.push(Some(child)),
            Err(e) => {
                signal_all(&ranks, libc::SIGKILL);
                return Err(format!("rank {rank} could not start: {e}"));
            }
        }
    }
    let mut failed: Option<(usize, ExitStatus)> = None;
    let mut stopping_since: Option<Instant> = None;
    let mut killed = false;
    let mut passed_on = 0;
    while ranks.iter().any(Option::is_some) {
        let asked = signals.count.load(Ordering::SeqCst);
        if asked > passed_on {
            pass_on(&ranks, asked);
            passed_on = asked;
        }
        for (rank, slot) in ranks.iter_mut().enumerate() {
            let Some(child) = slot.as_mut() else { continue };
            let status = child
                .try_wait()
                .map_err(|e| format!("rank {rank}'s status: {e}"))?;
            if let Some(status) = status {
                *slot = None;
                // Ranks asked to stop end with the signal's status.
                if !status.success() && failed.is_none() && passed_on == 0 {
                    eprintln!("strata launch: rank {rank} ended: {status}; stopping the others");
                    failed = Some((rank, status));
                }
            }
        }
        // The others asked to stop once, then, past the grace, killed.
        match (failed.is_some(), stopping_since) {
            (true, None) => {
                signal_all(&ranks, libc::SIGTERM);
                stopping_since = Some(Instant::now());
            }
            (true, Some(since)) if since.elapsed() >= GRACE && !killed => {
                signal_all(&ranks, libc::SIGKILL);
                killed = true;
            }
            _ => {}
        }
        std::thread::sleep(POLL);
    }
    if passed_on > 0 {
        return Ok(128 + signals.last.load(Ordering::SeqCst));
    }
    Ok(failed.map_or(0, |(_, status)| status.code().unwrap_or(1).max(1)))
}

/// The launcher's `asked`-th stop signal, passed on: the first as one
/// SIGTERM to each rank, any later one as a kill.
fn pass_on(ranks: &[Option<Child>], asked: usize) {
    let first = asked == 1;
    eprintln!(
        "strata launch: {}",
        match first {
            true => "asked to stop: each rank checkpoints after its step and stops",
            false => "asked again: killing the ranks",
        }
    );
    signal_all(ranks, if first { libc::SIGTERM } else { libc::SIGKILL });
}

/// `signal` to every rank still running (its process group).
fn signal_all(ranks: &[Option<Child>], signal: libc::c_int) {
    for child in ranks.iter().flatten() {
        crate::sys::signal_group(child.id(), signal);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_rank_is_told_its_place() {
        let c = rank_command(Path::new("/bin/strata"), &["train".into()], 1, 3, 29500);
        let env: Vec<(String, String)> = c
            .get_envs()
            .map(|(k, v)| {
                (
                    k.to_string_lossy().into(),
                    v.unwrap().to_string_lossy().into(),
                )
            })
            .collect();
        for (k, v) in [
            ("RANK", "1"),
            ("LOCAL_RANK", "1"),
            ("WORLD_SIZE", "3"),
            ("LOCAL_WORLD_SIZE", "3"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ] {
            assert!(env.contains(&(k.into(), v.into())), "{k}: {env:?}");
        }
        assert_eq!(c.get_args().collect::<Vec<_>>(), ["train"]);
    }

    fn sh(script: &str) -> Vec<OsString> {
        vec!["-c".into(), script.into()]
    }

    #[test]
    fn a_rank_that_fails_stops_the_others_and_names_the_status() {
        // Rank 1 fails at once; rank 0 would sleep a minute: it is stopped.
        let script = "if [ \"$RANK\" = 1 ]; then exit 7; fi; sleep 60";
        let quiet = StopSignals::new();
        let t0 = Instant::now();
        let code = run(Path::new("/bin/sh"), &sh(script), 2, 29501, &quiet).unwrap();
        assert_eq!(code, 7);
        assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
        // Every rank that ends well: 0.
        let code = run(Path::new("/bin/sh"), &sh("true"), 3, 29502, &quiet).unwrap();
        assert_eq!(code, 0);
    }

    /// `run` of `script` on 2 ranks while another thread sends it `count`
    /// stop signals `signal`, 300 ms apart; its status and how long it took.
    fn stopped(script: &str, signal: i32, count: usize, port: u16) -> (i32, Duration) {
        let signals = StopSignals::new();
        let t0 = Instant::now();
        let code = std::thread::scope(|s| {
            s.spawn(|| {
                for _ in 0..count {
                    std::thread::sleep(Duration::from_millis(300));
                    signals.last.store(signal, Ordering::SeqCst);
                    signals.count.fetch_add(1, Ordering::SeqCst);
                }
            });
            run(Path::new("/bin/sh"), &sh(script), 2, port, &signals)
        });
        (code.unwrap(), t0.elapsed())
    }

    #[test]
    fn a_stop_signal_is_passed_to_every_rank_once_and_a_second_kills() {
        let dir = tempfile::tempdir().unwrap();
        // Each rank writes its name when SIGTERM reaches it, and ends well
        // (as a trainer does after its checkpoint).
        let script = format!(
            "trap 'echo stopped > {}/rank-$RANK; exit 0' TERM; sleep 60 & wait",
            dir.path().display()
        );
        let (code, took) = stopped(&script, libc::SIGINT, 1, 29503);
        assert_eq!(code, 128 + libc::SIGINT);
        assert!(took < Duration::from_secs(20), "{took:?}");
        for r in 0..2 {
            let said = std::fs::read_to_string(dir.path().join(format!("rank-{r}"))).unwrap();
            assert_eq!(said.trim(), "stopped");
        }
        // Ranks that ignore the first: the second kills them.
        let (code, took) = stopped(
            "trap '' TERM; sleep 60 & wait; sleep 60",
            libc::SIGTERM,
            2,
            29504,
        );
        assert_eq!(code, 128 + libc::SIGTERM);
        assert!(took < Duration::from_secs(20), "{took:?}");
    }
}
