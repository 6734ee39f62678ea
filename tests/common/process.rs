//! Processes under a watchdog: a test that starts `strata` or `mpirun`
//! fails, with what the process said, when it runs past a bound, instead
//! of stalling the suite.

use std::io::Read;
use std::process::{Child, Command, Output, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Runs `cmd` to its end under [`wait_within`].
pub fn output_within(mut cmd: Command, what: &str, bound: Duration) -> Output {
    cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
    let child = cmd
        .spawn()
        .unwrap_or_else(|e| panic!("{what} does not start: {e}"));
    wait_within(child, what, bound)
}

/// Waits for `child` (started with piped stdout and stderr), reading both
/// as it writes them, so that a process that says much never blocks on a
/// full pipe. Past `bound` it gets SIGTERM (on which mpirun stops its
/// ranks), SIGKILL two seconds later, and the test fails naming `what`.
pub fn wait_within(mut child: Child, what: &str, bound: Duration) -> Output {
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("the child's status") {
            break status;
        }
        if start.elapsed() > bound {
            let _ = Command::new("kill").arg(child.id().to_string()).status();
            std::thread::sleep(Duration::from_secs(2));
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{what} did not end within {bound:?} (the watchdog's bound): it hangs\n{}{}",
                String::from_utf8_lossy(&joined(stdout)),
                String::from_utf8_lossy(&joined(stderr))
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output {
        status,
        stdout: joined(stdout),
        stderr: joined(stderr),
    }
}

/// A process's stdout and stderr, one after the other.
pub fn said(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn drain(pipe: Option<impl Read + Send + 'static>) -> Option<JoinHandle<Vec<u8>>> {
    pipe.map(|mut p| {
        std::thread::spawn(move || {
            let mut bytes = Vec::new();
            let _ = p.read_to_end(&mut bytes);
            bytes
        })
    })
}

fn joined(reader: Option<JoinHandle<Vec<u8>>>) -> Vec<u8> {
    reader.map_or_else(Vec::new, |r| r.join().unwrap_or_default())
}
