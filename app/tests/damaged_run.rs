//! `train --resume` on a store with a damaged record stops with an error
//! that names the expert, within a bound (under a watchdog), instead of
//! hanging as it once did (the prefetcher retried the record forever).

mod common;

use std::sync::atomic::AtomicBool;
use std::time::Duration;

use common::process::{output_within, said};
use common::tiny_lm::{small_flags, tiny_config, write_checkpoint};
use common::{bounded, damage_record};
use strata_cli::trainer::{self, Source, TrainFlags};

/// Far above what the case takes (well under a second).
const BOUND: Duration = Duration::from_secs(60);

/// `dir/run`: the tiny checkpoint (written to `dir/model`) fine-tuned for
/// two steps with experts streaming from the SSD.
fn finetuned_run(dir: &std::path::Path, checkpoint_every: Option<u64>) -> std::path::PathBuf {
    let out = dir.join("run");
    let model = dir.join("model");
    write_checkpoint(&model, &tiny_config());
    let base = small_flags(&out);
    let flags = TrainFlags {
        steps: Some(2),
        eval_every: Some(0),
        checkpoint_every: checkpoint_every.or(base.checkpoint_every),
        ..base
    };
    trainer::run(&flags, Source::Finetune(model), &AtomicBool::new(false)).unwrap();
    out
}

#[test]
fn train_resume_on_a_damaged_record_stops_with_an_error_naming_the_expert() {
    let dir = tempfile::tempdir().unwrap();
    let out = finetuned_run(dir.path(), None);
    damage_record(&out.join("experts.strata"), 0);
    let again = TrainFlags {
        resume: true,
        steps: Some(4),
        ..small_flags(&out)
    };
    let err = bounded("train --resume on a damaged record", BOUND, move || {
        trainer::run(&again, Source::Scratch, &AtomicBool::new(false))
            .expect_err("the damaged record is read without an error")
    });
    eprintln!("{err}");
    assert!(
        err.contains("expert 0.0") && err.contains("checksum"),
        "the error names neither the expert nor the checksum: {err}"
    );
}

/// `strata verify --run DIR` on `out`: its exit status and stdout.
fn verify(out: &std::path::Path) -> (Option<i32>, String) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["verify", "--run", out.to_str().unwrap()])
        .output()
        .unwrap();
    (
        output.status.code(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
    )
}

#[test]
fn verify_says_an_intact_run_is_intact_and_names_what_is_damaged() {
    let dir = tempfile::tempdir().unwrap();
    let out = finetuned_run(dir.path(), None);
    let (code, said) = verify(&out);
    assert_eq!(code, Some(0), "{said}");
    assert!(
        said.contains("checkpoint at step 2 is intact (8 expert records"),
        "{said}"
    );

    damage_record(&out.join("experts.strata"), 5);
    let dense = out.join("experts.strata.dense-2");
    let len = std::fs::metadata(&dense).unwrap().len();
    common::flip_byte(&dense, len / 2);
    let (code, said) = verify(&out);
    assert_eq!(code, Some(1), "{said}");
    assert!(
        said.contains("damaged: expert 1.1: payload checksum mismatch"),
        "{said}"
    );
    assert!(
        said.contains("experts.strata.dense-2: checksum mismatch"),
        "{said}"
    );
    assert!(
        said.contains("(1 of 8 expert records, and the dense state)"),
        "{said}"
    );
}

/// Runs `strata args…` under a watchdog of 30 s: its exit status and
/// stdout + stderr.
fn run_bounded(args: &[&str]) -> (Option<i32>, String) {
    let mut strata = std::process::Command::new(env!("CARGO_BIN_EXE_strata"));
    strata.args(args);
    let what = format!("`strata {}`", args.join(" "));
    let out = output_within(strata, &what, Duration::from_secs(30));
    (out.status.code(), said(&out))
}

fn copy_dir(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// One byte flipped in each region of a run's store (either superblock,
/// either copy map, a record's compute part, its state part) or in its
/// dense file: `train --resume`, `export` and `verify` each end within
/// 30 s, and either say what is damaged or, where an older checkpoint
/// stands in for a damaged newest one, say so in a note and go on.
#[test]
fn a_byte_flipped_in_each_region_is_named_and_nothing_hangs() {
    use strata_tiers::format::PART_HEADER_BYTES;
    let dir = tempfile::tempdir().unwrap();
    let run = finetuned_run(dir.path(), Some(1));
    let store = run.join("experts.strata");
    let layout =
        strata_tiers::ExpertStore::open(&store, None, &strata_tiers::io::FileOptions::default())
            .unwrap()
            .layout();
    let map_bytes = (16 * layout.expert_count()).next_multiple_of(4096);
    let compute = layout.compute_part_bytes();
    let both_copies = |at: u64| (0..2).map(move |c| layout.record_offset(3, c) + at);
    type Damage = (&'static str, Vec<(&'static str, u64)>);
    let regions: Vec<Damage> = vec![
        ("superblock A", vec![("experts.strata", 40)]),
        ("superblock B", vec![("experts.strata", 4096 + 40)]),
        ("copy map A", vec![("experts.strata", 8192 + 3)]),
        ("copy map B", vec![("experts.strata", 8192 + map_bytes + 3)]),
        (
            "compute part",
            both_copies(PART_HEADER_BYTES as u64 + 7)
                .map(|at| ("experts.strata", at))
                .collect(),
        ),
        (
            "state part",
            both_copies(compute + PART_HEADER_BYTES as u64 + 7)
                .map(|at| ("experts.strata", at))
                .collect(),
        ),
        ("dense file", vec![("experts.strata.dense-2", 100)]),
    ];
    for (region, flips) in regions {
        let case = dir.path().join(region.replace(' ', "-"));
        copy_dir(&run, &case);
        for (file, at) in flips {
            common::flip_byte(&case.join(file), at);
        }
        let out = case.to_str().unwrap();
        let to = dir
            .path()
            .join(format!("{}-export", region.replace(' ', "-")));
        let commands: [Vec<&str>; 3] = [
            vec!["verify", "--run", out],
            vec!["export", "--run", out, "--to", to.to_str().unwrap()],
            vec!["train", "--resume", "--out", out, "--steps", "3", "--quiet"],
        ];
        for args in commands {
            let (code, said) = run_bounded(&args);
            let what = format!("{region}, `strata {}`", args[0]);
            eprintln!("{what}: exit {code:?}\n{said}");
            match region {
                "compute part" | "state part" => {
                    assert_ne!(code, Some(0), "{what}: {said}");
                    let part = if region == "compute part" {
                        "compute"
                    } else {
                        "state"
                    };
                    assert!(
                        said.contains("expert 0.3"),
                        "{what} names no expert: {said}"
                    );
                    assert!(said.contains("checksum"), "{what}: {said}");
                    assert!(said.contains(part), "{what} names no part: {said}");
                }
                "dense file" => {
                    assert_ne!(code, Some(0), "{what}: {said}");
                    assert!(said.contains("experts.strata.dense-2"), "{what}: {said}");
                }
                _ => {
                    // A damaged older generation is never read; a damaged
                    // newest one is noted, and the previous checkpoint
                    // (whose dense file is kept) stands in.
                    assert_eq!(code, Some(0), "{what}: {said}");
                    if args[0] == "train" {
                        // --quiet: the header, the notes and the summary; no
                        // step lines.
                        assert!(said.contains("strata resume: "), "{what}: {said}");
                        assert!(said.contains("done: step 3"), "{what}: {said}");
                        assert!(!said.contains("  step "), "{what}: {said}");
                    }
                    if said.contains("note:") {
                        assert!(said.contains(&region[..region.len() - 2]), "{what}: {said}");
                    }
                }
            }
        }
    }
}
