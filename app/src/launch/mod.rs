//! `strata launch --nproc N -- train …`: N ranks of a training run on this
//! machine, each a process of its own, without knowing the launcher's
//! flags. With `--comm mpi` (the default) the ranks talk over MPI (a
//! strata built with `--features mpi`), so `strata launch` becomes
//! `mpirun -n N <this strata> train …`: it
//! prints that command line, then replaces itself with it (the same
//! process: a signal sent to it reaches mpirun, which passes it to the
//! ranks, and its exit status is mpirun's). With `--comm nccl` it starts
//! the ranks itself, as torchrun does ([`spawned`]). Across machines, run
//! mpirun, srun or torchrun directly (docs/training.md).

pub mod spawned;

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The strata commands that run as ranks.
const RANK_COMMANDS: &[&str] = &["train", "finetune"];

/// What `strata launch` was asked to start.
#[derive(Debug)]
pub struct Launch {
    pub nproc: usize,
    /// The MPI launcher (default: `mpirun` on PATH).
    pub mpirun: Option<PathBuf>,
    /// This strata's own arguments for each rank (`train …`).
    pub command: Vec<OsString>,
}

/// Which MPI's launcher it is: Open MPI's needs two flags MPICH's has no
/// use for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    OpenMpi,
    Other,
}

impl Launch {
    /// Checks the request and finds its launcher; the command to run.
    pub fn command(&self, strata: &Path) -> Result<Command, String> {
        if !cfg!(feature = "mpi") {
            return Err(
                "strata launch starts its ranks over MPI, and this strata was built \
                        without it: build it with --features mpi (Open MPI or MPICH \
                        installed, e.g. apt install libopenmpi-dev openmpi-bin)"
                    .into(),
            );
        }
        check(self.nproc, &self.command)?;
        let mpirun = self.mpirun.clone().unwrap_or_else(|| "mpirun".into());
        let flavor = flavor_of(&mpirun)?;
        Ok(mpirun_command(
            &mpirun,
            flavor,
            self.nproc,
            strata,
            &self.command,
            crate::sys::is_root(),
        ))
    }
}

/// Whether `nproc` ranks of `command` can be started: at least one, of a
/// command that runs as ranks.
pub fn check(nproc: usize, command: &[OsString]) -> Result<(), String> {
    if nproc == 0 {
        return Err("--nproc 0: a run needs at least one rank".into());
    }
    let first = command.first().and_then(|c| c.to_str());
    if !first.is_some_and(|c| RANK_COMMANDS.contains(&c)) {
        return Err(format!(
            "strata launch runs `train` or `finetune` as ranks, after `--` \
             (strata launch --nproc {nproc} -- train …); it was given {}",
            first.map_or("nothing".into(), |c| format!("`{c}`"))
        ));
    }
    Ok(())
}

/// Asks the launcher what it is; a missing one is named with how to get it.
fn flavor_of(mpirun: &Path) -> Result<Flavor, String> {
    let version = Command::new(mpirun)
        .arg("--version")
        .output()
        .map_err(|e| {
            format!(
                "{} could not be run ({e}): install Open MPI or MPICH (Debian, Ubuntu: \
             apt install openmpi-bin), or name its launcher with --mpirun",
                mpirun.display()
            )
        })?;
    let said = String::from_utf8_lossy(&version.stdout).to_string()
        + &String::from_utf8_lossy(&version.stderr);
    if !version.status.success() {
        return Err(format!(
            "`{} --version` failed ({}): is it an MPI launcher (mpirun, mpiexec)? {}",
            mpirun.display(),
            version.status,
            said.trim()
        ));
    }
    Ok(
        match said.contains("Open MPI") || said.contains("OpenRTE") {
            true => Flavor::OpenMpi,
            false => Flavor::Other,
        },
    )
}

/// `mpirun -n N strata train …`. Open MPI counts a rank per core and
/// refuses more ranks than cores without `--oversubscribe`, and refuses to
/// run as root unless told that it is meant (containers often are root).
pub fn mpirun_command(
    mpirun: &Path,
    flavor: Flavor,
    nproc: usize,
    strata: &Path,
    command: &[OsString],
    root: bool,
) -> Command {
    let mut c = Command::new(mpirun);
    if flavor == Flavor::OpenMpi {
        c.arg("--oversubscribe");
        if root {
            c.env("OMPI_ALLOW_RUN_AS_ROOT", "1")
                .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
        }
    }
    c.args(["-n", &nproc.to_string()]).arg(strata).args(command);
    c
}

/// The command line as a shell would take it, and the variables it sets.
pub fn describe(c: &Command) -> String {
    let quote = |s: &OsStr| {
        let s = s.to_string_lossy();
        match s
            .chars()
            .all(|ch| ch.is_ascii_alphanumeric() || "-_./=:,@+".contains(ch))
        {
            true if !s.is_empty() => s.into_owned(),
            _ => format!("'{}'", s.replace('\'', r"'\''")),
        }
    };
    let envs = c
        .get_envs()
        .filter_map(|(k, v)| Some(format!("{}={}", quote(k), quote(v?))));
    let words = std::iter::once(quote(c.get_program())).chain(c.get_args().map(quote));
    envs.chain(words).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(c: &Command) -> Vec<String> {
        c.get_args().map(|a| a.to_string_lossy().into()).collect()
    }

    #[test]
    fn open_mpi_gets_its_flags_and_mpich_none() {
        let command: Vec<OsString> = ["train", "--out", "my run"].map(Into::into).to_vec();
        let strata = Path::new("/opt/strata");
        let open = mpirun_command(
            Path::new("mpirun"),
            Flavor::OpenMpi,
            2,
            strata,
            &command,
            true,
        );
        assert_eq!(
            words(&open),
            [
                "--oversubscribe",
                "-n",
                "2",
                "/opt/strata",
                "train",
                "--out",
                "my run"
            ]
        );
        assert_eq!(
            describe(&open),
            "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun \
             --oversubscribe -n 2 /opt/strata train --out 'my run'"
        );
        let user = mpirun_command(
            Path::new("mpirun"),
            Flavor::OpenMpi,
            2,
            strata,
            &command,
            false,
        );
        assert_eq!(user.get_envs().count(), 0);
        let mpich = mpirun_command(
            Path::new("mpiexec"),
            Flavor::Other,
            4,
            strata,
            &command,
            true,
        );
        assert_eq!(
            words(&mpich),
            ["-n", "4", "/opt/strata", "train", "--out", "my run"]
        );
        assert_eq!(mpich.get_envs().count(), 0);
    }

    #[test]
    fn only_ranks_of_train_or_finetune_are_started() {
        let command = |words: &[&str]| -> Vec<OsString> { words.iter().map(Into::into).collect() };
        assert!(check(2, &command(&["train", "--out", "r"])).is_ok());
        assert!(check(1, &command(&["finetune"])).is_ok());
        let refused = |n, words: &[&str], says: &str| {
            let e = check(n, &command(words)).unwrap_err();
            assert!(e.contains(says), "{e}");
        };
        refused(0, &["train"], "--nproc 0");
        refused(2, &[], "it was given nothing");
        refused(3, &["export"], "it was given `export`");
    }

    #[test]
    fn a_request_that_cannot_run_says_why() {
        let launch = |nproc, command: &[&str], mpirun: Option<&str>| Launch {
            nproc,
            mpirun: mpirun.map(PathBuf::from),
            command: command.iter().map(Into::into).collect(),
        };
        let refused = |l: Launch, says: &str| {
            let e = l.command(Path::new("strata")).unwrap_err();
            assert!(e.contains(says), "{e}");
        };
        if !cfg!(feature = "mpi") {
            refused(launch(2, &["train"], None), "build it with --features mpi");
            return;
        }
        refused(launch(0, &["train"], None), "--nproc 0");
        refused(launch(2, &[], None), "it was given nothing");
        refused(launch(2, &["bench", "step"], None), "it was given `bench`");
        refused(
            launch(2, &["train"], Some("/nonexistent/mpirun")),
            "/nonexistent/mpirun could not be run",
        );
        refused(
            launch(2, &["train"], Some("false")),
            "`false --version` failed",
        );
    }
}
