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

use std::ffi::OsString;
use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

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
    c.args(command)
        .env("RANK", rank.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("WORLD_SIZE", nproc.to_string())
        .env("LOCAL_WORLD_SIZE", nproc.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string());
    c
}

/// Starts every rank and waits for them all; the first failed rank's
/// status, or success.
pub fn run(strata: &Path, command: &[OsString], nproc: usize, port: u16) -> Result<i32, String> {
    let mut ranks: Vec<Option<Child>> = Vec::with_capacity(nproc);
    for rank in 0..nproc {
        match rank_command(strata, command, rank, nproc, port).spawn() {
            Ok(child) => ranks.push(Some(child)),
            Err(e) => {
                stop(&mut ranks, Instant::now());
                return Err(format!("rank {rank} could not start: {e}"));
            }
        }
    }
    let mut failed: Option<(usize, ExitStatus)> = None;
    let mut stopping_since = None;
    while ranks.iter().any(Option::is_some) {
        for (rank, slot) in ranks.iter_mut().enumerate() {
            let Some(child) = slot.as_mut() else { continue };
            let status = child
                .try_wait()
                .map_err(|e| format!("rank {rank}'s status: {e}"))?;
            if let Some(status) = status {
                *slot = None;
                if !status.success() && failed.is_none() {
                    eprintln!("strata launch: rank {rank} ended: {status}; stopping the others");
                    failed = Some((rank, status));
                }
            }
        }
        if failed.is_some() {
            let since = *stopping_since.get_or_insert_with(Instant::now);
            stop(&mut ranks, since);
        }
        std::thread::sleep(POLL);
    }
    Ok(failed.map_or(0, |(_, status)| status.code().unwrap_or(1).max(1)))
}

/// Asks the ranks still running to stop (SIGTERM), and kills them once
/// [`GRACE`] has passed since `since`.
fn stop(ranks: &mut [Option<Child>], since: Instant) {
    let late = since.elapsed() >= GRACE;
    for child in ranks.iter_mut().flatten() {
        if late {
            let _ = child.kill();
        } else {
            crate::sys::terminate(child.id());
        }
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

    #[test]
    fn a_rank_that_fails_stops_the_others_and_names_the_status() {
        // Rank 1 fails at once; rank 0 would sleep a minute: it is stopped.
        let script = "if [ \"$RANK\" = 1 ]; then exit 7; fi; sleep 60";
        let t0 = Instant::now();
        let code = run(
            Path::new("/bin/sh"),
            &["-c".into(), script.into()],
            2,
            29501,
        )
        .unwrap();
        assert_eq!(code, 7);
        assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
        // Every rank that ends well: 0.
        assert_eq!(
            run(
                Path::new("/bin/sh"),
                &["-c".into(), "true".into()],
                3,
                29502
            )
            .unwrap(),
            0
        );
    }
}
