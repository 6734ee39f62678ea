//! A child process checkpoints a real store file in a loop and is killed
//! with SIGKILL at an arbitrary moment; the file must reopen at a committed
//! step whose every record reads back exactly.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use strata_tiers::io::{AlignedBuf, FileOptions};
use strata_tiers::{record_mut, Dtype, ExpertId, ExpertStore, Layout, Parts};

const CHILD_ENV: &str = "STRATA_SIGKILL_CHILD_STORE";

fn layout() -> Layout {
    Layout {
        layers: 2,
        experts_per_layer: 4,
        params_per_expert: 64 * 1024,
        compute_dtype: Dtype::Bf16,
        moments: true,
    }
}

/// Step s rewrites the experts whose dense index ≡ s (mod 3); the value of
/// every param is a function of (expert, step).
fn value(expert: ExpertId, step: u64) -> f32 {
    (expert.layer * 10 + expert.index) as f32 * 1000.0 + step as f32
}

fn touched(slot: u64, step: u64) -> bool {
    step == 1 || slot % 3 == step % 3
}

/// The step at which `slot` was last written, as of committed step `step`.
fn last_write(slot: u64, step: u64) -> u64 {
    (1..=step)
        .rev()
        .find(|&s| touched(slot, s))
        .expect("step 1 writes all")
}

fn fill(layout: &Layout, expert: ExpertId, step: u64, buf: &mut [u8]) {
    let r = record_mut(layout, buf).unwrap();
    let x = value(expert, step);
    r.master.fill(x);
    r.m.fill(x + 0.5);
    r.v.fill(x + 0.25);
    let h = half::bf16::from_f32(x).to_bits().to_le_bytes();
    for pair in r.compute.chunks_exact_mut(2) {
        pair.copy_from_slice(&h);
    }
}

fn child(path: &Path) -> ! {
    let layout = layout();
    let store = ExpertStore::create(path, layout, &FileOptions::default()).unwrap();
    let mut buf = AlignedBuf::zeroed(layout.record_bytes() as usize);
    for step in 1u64.. {
        for slot in 0..layout.expert_count() {
            if touched(slot, step) {
                let e = layout.expert_at(slot);
                fill(&layout, e, step, buf.as_mut_slice());
                store.write(e, step, buf.as_mut_slice()).unwrap();
            }
        }
        store.checkpoint(step).unwrap();
        println!("committed {step}");
    }
    unreachable!()
}

#[test]
fn sigkill_child_entry() {
    // Runs only as the child process of the test below.
    if let Ok(path) = std::env::var(CHILD_ENV) {
        child(Path::new(&path));
    }
}

#[test]
fn a_store_killed_mid_checkpoint_reopens_at_a_committed_step() {
    let dir = tempfile::tempdir().unwrap();
    for round in 0..3u64 {
        let path = dir.path().join(format!("killed-{round}.strata"));
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "sigkill_child_entry",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, &path)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        // Let it commit a few steps, then kill it a little later, at
        // whatever point of its write/checkpoint loop it has reached.
        let mut reported = 0;
        while reported < 3 + round {
            let line = lines.next().expect("child output").unwrap();
            if let Some(step) = line.strip_prefix("committed ") {
                reported = step.parse().unwrap();
            }
        }
        std::thread::sleep(Duration::from_millis(3 + 7 * round));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();

        let layout = layout();
        let store = ExpertStore::open(&path, Some(layout), &FileOptions::default()).unwrap();
        let step = store.committed_step();
        assert!(step >= reported, "committed {step} < reported {reported}");
        let mut buf = AlignedBuf::zeroed(layout.record_bytes() as usize);
        let mut want = AlignedBuf::zeroed(layout.record_bytes() as usize);
        for slot in 0..layout.expert_count() {
            let e = layout.expert_at(slot);
            let written = store.read(e, Parts::Full, buf.as_mut_slice()).unwrap();
            assert_eq!(written, last_write(slot, step), "expert {e}");
            fill(&layout, e, written, want.as_mut_slice());
            let got = record_mut(&layout, buf.as_mut_slice()).unwrap();
            let expected = record_mut(&layout, want.as_mut_slice()).unwrap();
            assert!(
                got.compute == expected.compute,
                "expert {e}: compute differs"
            );
            assert!(got.master == expected.master, "expert {e}: master differs");
            assert!(
                got.m == expected.m && got.v == expected.v,
                "expert {e}: moments differ"
            );
        }
        eprintln!("round {round}: killed after step {reported}, reopened at {step}");
    }
}
