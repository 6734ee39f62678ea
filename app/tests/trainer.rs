//! The trainer end to end: fine-tuning a Mixtral-layout checkpoint written
//! here (config.json + sharded safetensors + index) through SSD offload,
//! export and re-import; a run killed with SIGKILL and resumed against an
//! uninterrupted one; bad input refused with one line and nothing written.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use common::max_rel;
use common::tiny_lm::{
    flags_holding, run_params, small_flags, small_flags_on, tiny_config, write_checkpoint,
};
use strata::engine::{Engine, EngineConfig};
use strata::lm::{LmConfig, MoeLm};
use strata_cli::trainer::{self, hf, Source, TrainFlags};
use strata_tiers::Dtype;

/// `--dense-on-host` steps the dense params with the cpu's AdamW where the
/// default keeps them on the one GPU and steps them there: the same
/// gradient, the same element update, so the same bits, in fewer copies.
#[cfg(feature = "cuda")]
#[test]
fn the_dense_params_train_alike_on_the_gpu_and_on_the_host() {
    if let Err(e) = strata::backend::BackendKind::Cuda.check(0..1, Dtype::Bf16) {
        common::cuda_case_skipped(e);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let model = dir.path().join("model");
    write_checkpoint(&model, &config);
    let run = |name: &str, dense_on_host: bool| {
        let out = dir.path().join(name);
        let flags = TrainFlags {
            backend: Some("cuda".into()),
            steps: Some(3),
            dense_on_host,
            ..small_flags(&out)
        };
        let source = Source::Finetune(model.clone());
        let summary = trainer::run(&flags, source, &AtomicBool::new(false)).unwrap();
        let log = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let copied: Vec<u64> = log
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v.get("bytes_pcie_other").and_then(|b| b.as_u64()))
            .collect();
        (summary.last_loss, run_params(&out, &config), copied)
    };
    let (kept_loss, kept, kept_copied) = run("kept", false);
    let (host_loss, host, host_copied) = run("host", true);
    eprintln!(
        "cuda case: dense params kept on the gpu copied {kept_copied:?} a step, \
         stepped on the host {host_copied:?}"
    );
    assert_eq!(kept_loss, host_loss);
    assert!(kept == host, "the params differ");
    assert!(
        kept_copied[2] < host_copied[2],
        "{kept_copied:?} {host_copied:?}"
    );
}

/// The trainer on the GPUs (`--backend cuda --devices 2`, or 1 where only
/// one GPU answers, with two micro-batches) against the cpu backend on one
/// device with two micro-batches. The GPU rounds the experts' GEMMs' operands to bf16
/// (2⁻⁹ relative); AdamW turns a gradient difference into at most ~2·lr of
/// param difference a step (|m/√v| ≲ 1), so 6 steps at lr ≤ 3e-3 keep
/// every param within 4e-2; the losses, which see the params only through
/// those moves, agree to 1 %. The dense GEMMs, attention and
/// cross-entropy run on the GPU too. Runs wherever a CUDA device answers
/// (a GPU, or the CPU model of one in CI); skips, saying why, elsewhere.
#[cfg(feature = "cuda")]
#[test]
fn the_trainer_runs_on_the_gpus() {
    let gpus = if strata::backend::BackendKind::Cuda
        .check(0..2, Dtype::Bf16)
        .is_ok()
    {
        2
    } else if let Err(e) = strata::backend::BackendKind::Cuda.check(0..1, Dtype::Bf16) {
        common::cuda_case_skipped(e);
        return;
    } else {
        1
    };
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let model = dir.path().join("model");
    write_checkpoint(&model, &config);
    let run = |name: &str, backend: &str, devices: usize, micro_batches: usize| {
        let out = dir.path().join(name);
        let flags = TrainFlags {
            backend: Some(backend.into()),
            devices: Some(devices),
            micro_batches: Some(micro_batches),
            ..small_flags(&out)
        };
        let summary = trainer::run(
            &flags,
            Source::Finetune(model.clone()),
            &AtomicBool::new(false),
        )
        .unwrap();
        assert_eq!(summary.steps, 6);
        (summary.last_loss.unwrap(), run_params(&out, &config))
    };
    // The same two micro-batches of the step either way: one on each GPU,
    // or both on the one GPU, or both on the cpu device.
    let (gpu_loss, (gpu_dense, gpu_experts)) = run("gpus", "cuda", gpus, 2 / gpus);
    let (cpu_loss, (cpu_dense, cpu_experts)) = run("cpu", "cpu", 1, 2);
    let experts = gpu_experts
        .iter()
        .zip(&cpu_experts)
        .map(|(a, b)| max_rel(a, b))
        .fold(0.0f32, f32::max);
    let dense = max_rel(&gpu_dense, &cpu_dense);
    eprintln!(
        "cuda case: {gpus} GPU(s) vs one cpu device: loss {gpu_loss} vs {cpu_loss}, \
         params dense {dense:.2e}, experts {experts:.2e}"
    );
    assert!((gpu_loss - cpu_loss).abs() <= 0.01 * cpu_loss.abs());
    assert!(dense < 4e-2 && experts < 4e-2, "{dense} {experts}");
}

#[test]
fn finetune_through_ssd_offload_exports_and_reimports() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let model = dir.path().join("model");
    let (dense0, experts0) = write_checkpoint(&model, &config);
    let out = dir.path().join("run");
    let export = dir.path().join("export");
    let flags = TrainFlags {
        export: Some(export.clone()),
        ..small_flags(&out)
    };
    let summary = trainer::run(
        &flags,
        Source::Finetune(model.clone()),
        &AtomicBool::new(false),
    )
    .unwrap();
    assert_eq!(summary.plan.mode, trainer::plan::OffloadMode::HostAndSsd);
    assert_eq!(summary.steps, 6);
    assert!(summary.last_eval_loss.is_some());
    // The run moved away from the checkpoint it started from …
    let (dense, experts) = run_params(&out, &config);
    assert_ne!(dense, dense0);
    assert_ne!(experts, experts0);
    // … and the export holds exactly its params, in the same layout.
    let reread = hf::read_config(&export).unwrap();
    assert_eq!(
        reread,
        LmConfig {
            seed: 0,
            ..config.clone()
        }
    );
    let lm = MoeLm::new(config.clone()).unwrap();
    let (ckpt, exported_dense) = hf::read_dense(&export, &lm).unwrap();
    assert_eq!(exported_dense, dense);
    let (d, f) = (config.d_model, config.d_ff);
    for l in 0..config.layers {
        for e in 0..config.experts {
            let mut w = vec![0.0f32; 3 * d * f];
            for (i, name) in ["w1", "w3", "w2"].iter().enumerate() {
                let shape = if i < 2 { [f, d] } else { [d, f] };
                ckpt.read_f32(
                    &format!("model.layers.{l}.block_sparse_moe.experts.{e}.{name}.weight"),
                    &shape,
                    &mut w[i * d * f..(i + 1) * d * f],
                )
                .unwrap();
            }
            assert_eq!(w, experts[l * config.experts + e], "expert {l}.{e}");
        }
    }
    // Re-importing the export through the fine-tune path (store import,
    // then an engine over it) gives back exactly the same params.
    let path = dir.path().join("reimport.strata");
    let layout = strata_tiers::Layout {
        layers: config.layers as u32,
        experts_per_layer: config.experts as u32,
        params_per_expert: config.expert_params() as u64,
        compute_dtype: Dtype::Bf16,
        moments: true,
    };
    let store = strata_tiers::ExpertStore::create(&path, layout, &Default::default()).unwrap();
    hf::import_store(&ckpt, &config, &store, |_, _| {}).unwrap();
    drop(store);
    let mut engine = Engine::open_imported(
        &lm,
        EngineConfig {
            store_path: Some(path),
            compute_dtype: Dtype::Bf16,
            device_budget_bytes: 1 << 20,
            host_budget_bytes: 1 << 20,
            optimizer_threads: 1,
            ..EngineConfig::default()
        },
        exported_dense,
    )
    .unwrap();
    assert_eq!(engine.dense_params().unwrap(), &dense[..]);
    for l in 0..config.layers {
        for e in 0..config.experts {
            assert_eq!(
                engine.expert_params(l, e).unwrap(),
                experts[l * config.experts + e]
            );
        }
    }
}

/// How the host slots split where records stream (`--host-stream-slots`,
/// `--host-cell-slots`) moves records at other times,
/// not what the steps compute: two runs under different splits end on
/// the same bits, and the plan says how each split.
#[test]
fn the_host_tiers_split_changes_the_traffic_not_the_params() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let model = dir.path().join("model");
    write_checkpoint(&model, &config);
    let run = |name: &str, split: TrainFlags| {
        let out = dir.path().join(name);
        let flags = TrainFlags {
            host_stream_slots: split.host_stream_slots,
            host_cell_slots: split.host_cell_slots,
            ..flags_holding(&out, 6)
        };
        let summary = trainer::run(
            &flags,
            Source::Finetune(model.clone()),
            &AtomicBool::new(false),
        )
        .unwrap();
        (summary, run_params(&out, &config))
    };
    let (plain, plain_params) = run("plain", TrainFlags::default());
    let (split, split_params) = run(
        "split",
        TrainFlags {
            host_stream_slots: Some(trainer::StreamSlots(None)),
            host_cell_slots: Some(1),
            ..TrainFlags::default()
        },
    );
    // Six host slots: by default 4 stream and 2 keep a record; split, one
    // is cut into compute cells and the other five all stream.
    assert_eq!(plain.plan.host_slots, 6);
    assert_eq!((plain.plan.host_kept, plain.plan.host_cell_slots), (2, 0));
    assert_eq!((split.plan.host_kept, split.plan.host_cell_slots), (0, 1));
    assert!(
        split.plan.describe().contains("(1 in compute cells)"),
        "{}",
        split.plan.describe()
    );
    assert_eq!(plain.last_loss, split.last_loss);
    assert_eq!(plain.last_eval_loss, split.last_eval_loss);
    assert!(plain_params == split_params, "the params differ");

    // A run stopped after its first step, its directory moved, and
    // resumed there under another split (the flags are taken on
    // --resume) ends on the same bits as well.
    let before_move = dir.path().join("before-move");
    let first = TrainFlags {
        host_cell_slots: Some(1),
        ..flags_holding(&before_move, 6)
    };
    let stopped = trainer::run(
        &first,
        Source::Finetune(model.clone()),
        &AtomicBool::new(true),
    )
    .unwrap();
    assert!(stopped.interrupted && stopped.steps == 1, "{stopped:?}");
    let out = dir.path().join("resumed");
    std::fs::rename(&before_move, &out).unwrap();
    let again = TrainFlags {
        resume: true,
        host_stream_slots: Some(trainer::StreamSlots(Some(3))),
        host_cell_slots: Some(0),
        ..flags_holding(&out, 6)
    };
    let resumed = trainer::run(&again, Source::Scratch, &AtomicBool::new(false)).unwrap();
    assert_eq!(
        (resumed.plan.host_kept, resumed.plan.host_cell_slots),
        (3, 0)
    );
    assert_eq!(resumed.last_loss, plain.last_loss);
    assert!(
        run_params(&out, &config) == plain_params,
        "the params differ"
    );
    // The record now holds what the run went on with, for the next --resume.
    let record: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
    let options = &record["options"];
    assert_eq!(options["out"].as_str(), out.to_str());
    assert_eq!(options["host_stream_slots"], 3);
    assert_eq!(options["host_cell_slots"], 0);
}

/// `--devices 2` (one micro-batch each) trains the model one device
/// trains with two micro-batches, through the same SSD offload: the two
/// differ only in the order of float sums (tests/multi_device.rs bounds
/// that for the plain stack); here the experts' compute copies are bf16,
/// so a master param a rounding apart can round its copy one bf16 ulp
/// (2⁻⁸ relative) apart, and 6 steps keep the params within 1e-3.
#[test]
fn two_devices_train_the_model_one_device_trains_with_two_micro_batches() {
    let dir = tempfile::tempdir().unwrap();
    let config = tiny_config();
    let model = dir.path().join("model");
    write_checkpoint(&model, &config);
    let run = |name: &str, devices: usize, micro_batches: usize| {
        let out = dir.path().join(name);
        let flags = TrainFlags {
            // Each layer's exchange in two parts, or in those its cost
            // model chooses, where there are devices to exchange with: the
            // same bits as one (below).
            pipeline: Some(
                match name {
                    "in-parts" => "2",
                    "auto" => "auto",
                    _ => "off",
                }
                .into(),
            ),
            ..small_flags_on(&out, devices, micro_batches)
        };
        let summary = trainer::run(
            &flags,
            Source::Finetune(model.clone()),
            &AtomicBool::new(false),
        )
        .unwrap();
        assert_eq!(summary.plan.devices, devices as u64);
        assert_eq!(summary.steps, 6);
        run_params(&out, &config)
    };
    let (dense2, experts2) = run("two-devices", 2, 1);
    let (dense_parts, experts_parts) = run("in-parts", 2, 1);
    assert!(dense_parts == dense2 && experts_parts == experts2);
    let (dense_auto, experts_auto) = run("auto", 2, 1);
    assert!(dense_auto == dense2 && experts_auto == experts2);
    let (dense1, experts1) = run("one-device", 1, 2);
    let dense = max_rel(&dense2, &dense1);
    let experts = experts2
        .iter()
        .zip(&experts1)
        .map(|(a, b)| max_rel(a, b))
        .fold(0.0f32, f32::max);
    eprintln!(
        "two devices vs one with two micro-batches: dense {dense:.2e}, experts {experts:.2e}"
    );
    assert!(
        dense < 1e-3 && experts < 1e-3,
        "dense {dense}, experts {experts}"
    );
}

fn strata_bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_strata"))
}

fn cli_args(out: &Path, steps: u64) -> Vec<String> {
    [
        "train",
        "--out",
        out.to_str().unwrap(),
        "--steps",
        &steps.to_string(),
        "--seq-len",
        "16",
        "--batch",
        "4",
        "--checkpoint-every",
        "5",
        "--eval-every",
        "10",
        "--device-mem",
        "3MiB",
        "--host-mem",
        "1536KiB",
        "--threads",
        "2",
        "--quiet",
    ]
    .map(String::from)
    .to_vec()
}

fn committed_checkpoints(out: &Path) -> usize {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .map(|t| t.matches("\"checkpoint\":true").count())
        .unwrap_or(0)
}

#[test]
fn a_run_killed_after_a_checkpoint_resumes_bit_identically() {
    let dir = tempfile::tempdir().unwrap();
    let steps = 60;
    let straight = dir.path().join("straight");
    let status = strata_bin()
        .args(cli_args(&straight, steps))
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(status.success());

    let killed = dir.path().join("killed");
    let mut child = strata_bin()
        .args(cli_args(&killed, steps))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    while committed_checkpoints(&killed) < 1 {
        assert!(Instant::now() < deadline, "no checkpoint within 120 s");
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it was killed"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let done = committed_checkpoints(&killed);
    assert!(
        done < steps as usize / 5,
        "killed mid-run (after {done} checkpoints)"
    );

    let resumed = strata_bin()
        .args([
            "train",
            "--resume",
            "--out",
            killed.to_str().unwrap(),
            "--quiet",
        ])
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(resumed.success());
    let config = {
        let text = std::fs::read_to_string(straight.join("config.json")).unwrap();
        LmConfig::from_hf_json(&text).unwrap()
    };
    let config = LmConfig { seed: 0, ..config };
    assert_eq!(run_params(&straight, &config), run_params(&killed, &config));
}

/// Runs `strata ARGS` expecting failure: one line on stderr, non-zero exit.
fn refused(args: &[&str], expect: &str) {
    let out = strata_bin().args(args).output().unwrap();
    assert!(!out.status.success(), "{args:?} succeeded");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
    assert!(err.contains(expect), "{args:?}: {err}");
}

#[test]
fn bad_input_is_refused_with_one_line_and_nothing_written() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let o = out.to_str().unwrap();
    refused(
        &["train", "--out", o, "--data", "/no/such/file.txt"],
        "does not exist",
    );
    if !cfg!(feature = "nccl") {
        refused(
            &["launch", "--comm", "nccl", "--nproc", "2", "--", "train"],
            "built with --features nccl",
        );
    }
    refused(
        &[
            "launch", "--comm", "nccl", "--mpirun", "mpiexec", "--nproc", "2", "--", "train",
        ],
        "--mpirun names MPI's launcher",
    );
    refused(
        &["train", "--out", o, "--devices", "2", "--pipeline", "fast"],
        "--pipeline \"fast\": give off, auto, or the parts",
    );
    refused(
        &["finetune", "--out", o, "--model", "/no/such/model"],
        "does not exist",
    );
    let model = dir.path().join("hub-model");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(
        model.join("config.json"),
        "{\"model_type\": \"deepseek_v3\"}",
    )
    .unwrap();
    refused(
        &["finetune", "--out", o, "--model", model.to_str().unwrap()],
        "model_type \"deepseek_v3\" is not supported",
    );
    let m = model.to_str().unwrap();
    refused(
        &["finetune", "--out", m, "--model", m],
        "is the model directory",
    );
    refused(
        &["finetune", "--out", o, "--model", m, "--export", m],
        "--export",
    );
    let mut config: serde_json::Value = serde_json::from_str(&tiny_config().to_hf_json()).unwrap();
    config["rope_scaling"] = serde_json::json!({"type": "linear", "factor": 2.0});
    std::fs::write(model.join("config.json"), config.to_string()).unwrap();
    refused(
        &["finetune", "--out", o, "--model", model.to_str().unwrap()],
        "rope_scaling",
    );
    refused(&["train", "--out", o, "--device-mem", "64KiB"], "short");
    refused(
        &["train", "--out", o, "--threads", "100000"],
        "--threads 100000: at most",
    );
    refused(
        &["train", "--out", o, "--backend", "tpu"],
        "unknown backend",
    );
    // Without the cuda feature, or on a machine without a GPU, --backend
    // cuda says why and how to run without it.
    if strata::backend::BackendKind::Cuda
        .check(0..1, Dtype::Bf16)
        .is_err()
    {
        refused(
            &["train", "--out", o, "--backend", "cuda"],
            if cfg!(feature = "cuda") {
                "no GPU to use"
            } else {
                "without the cuda feature"
            },
        );
    }
    // The cuda backend reads bf16 (or f32) expert params, wherever it runs.
    refused(
        &[
            "train",
            "--out",
            o,
            "--backend",
            "cuda",
            "--compute-dtype",
            "f16",
        ],
        "--compute-dtype bf16",
    );
    refused(&["train", "--out", o, "--devices", "0"], "--devices");
    // Tiny's records are 344 KiB and its dense moments 459.5 KiB: six
    // host slots, four of them cut into compute cells, leave two for
    // records, one fewer than streaming them needs.
    refused(
        &[
            "plan",
            "--host-mem",
            "2600KiB",
            "--device-mem",
            "64MiB",
            "--host-cell-slots",
            "4",
        ],
        "--host-cell-slots 4 leaves 2 of the 6 host slots",
    );
    refused(
        &["train", "--out", o, "--devices", "4", "--batch", "2"],
        "--devices 4",
    );
    refused(
        &[
            "plan",
            "--preset",
            "moe-l",
            "--device-mem",
            "1TiB",
            "--host-mem",
            "1GiB",
        ],
        "--host-mem",
    );
    let empty = dir.path().join("empty.txt");
    std::fs::write(&empty, "").unwrap();
    refused(
        &["train", "--out", o, "--data", empty.to_str().unwrap()],
        "dataset is empty",
    );
    refused(&["train", "--out", o, "--resume"], "cannot resume");
    assert!(!out.exists(), "nothing was written");
    // A model directory whose tensors are missing: refused before the run
    // directory is made.
    let model = dir.path().join("hollow");
    std::fs::create_dir_all(&model).unwrap();
    std::fs::write(model.join("config.json"), tiny_config().to_hf_json()).unwrap();
    refused(
        &["finetune", "--out", o, "--model", model.to_str().unwrap()],
        "safetensors",
    );
    assert!(!out.exists(), "nothing was written");
}

#[test]
fn ctrl_c_checkpoints_and_exits_130() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut args = cli_args(&out, 100_000);
    let at = args.iter().position(|a| a == "--checkpoint-every").unwrap();
    args[at + 1] = "0".into(); // only the interrupt checkpoints
    let child = strata_bin()
        .args(&args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(120);
    // Wait until steps are being written, then interrupt.
    while std::fs::read_to_string(out.join("metrics.jsonl")).map_or(0, |t| t.lines().count()) < 3 {
        assert!(Instant::now() < deadline, "no steps within 120 s");
        std::thread::sleep(Duration::from_millis(5));
    }
    common::signal(&child, "INT");
    let output = child.wait_with_output().unwrap();
    assert_eq!(output.status.code(), Some(130));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("--resume"), "{stdout}");
    assert_eq!(committed_checkpoints(&out), 1);
}

/// With the driver but not NVRTC or cuBLAS on the library path,
/// `--backend cuda` is refused up front, naming the missing library and
/// where the toolkit's libraries go, and writes nothing. Needs a CUDA
/// driver library (a GPU's, or the CPU model of one in CI) on
/// LD_LIBRARY_PATH: the runs load it from a folder of its own.
#[cfg(feature = "cuda")]
#[test]
fn cuda_without_its_libraries_is_refused_naming_them() {
    let path = std::env::var("LD_LIBRARY_PATH").unwrap_or_default();
    let dirs: Vec<&Path> = path.split(':').map(Path::new).collect();
    let Some(driver) = dirs
        .iter()
        .map(|d| d.join("libcuda.so"))
        .find(|f| f.exists())
    else {
        return common::cuda_case_skipped("no libcuda.so on LD_LIBRARY_PATH");
    };
    let dir = tempfile::tempdir().unwrap();
    let libs = dir.path().join("driver-only");
    std::fs::create_dir(&libs).unwrap();
    std::fs::copy(&driver, libs.join("libcuda.so")).unwrap();
    let refused = |library_path: std::ffi::OsString, missing: &str| {
        let out = dir.path().join("run");
        let run = strata_bin()
            .args(["train", "--backend", "cuda", "--steps", "1", "--out"])
            .arg(&out)
            .env("LD_LIBRARY_PATH", library_path)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&run.stderr);
        assert!(!run.status.success(), "{err}");
        assert!(
            err.contains(&format!("no {missing} library found")) && err.contains("LD_LIBRARY_PATH"),
            "{err}"
        );
        assert!(!out.exists(), "{} was written", out.display());
    };
    refused(libs.clone().into_os_string(), "NVRTC");
    // NVRTC from its folder on the path, where that folder has no cuBLAS.
    if let Some(nvrtc) = dirs.iter().find(|d| {
        std::fs::read_dir(d).is_ok_and(|entries| {
            let names: Vec<String> = entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            names.iter().any(|n| n.starts_with("libnvrtc.so"))
                && !names.iter().any(|n| n.starts_with("libcublas"))
        })
    }) {
        refused(
            std::env::join_paths([libs.as_path(), nvrtc]).unwrap(),
            "cuBLAS",
        );
    }
}

#[test]
fn timeline_step_writes_that_steps_chrome_trace() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut args = cli_args(&out, 3);
    args.extend(["--timeline-step", "2"].map(String::from));
    let run = strata_bin().args(&args).output().unwrap();
    assert!(run.status.success(), "{run:?}");
    assert!(!out.join("timeline-step-1.json").exists());
    let text = std::fs::read_to_string(out.join("timeline-step-2.json")).unwrap();
    let trace: serde_json::Value = serde_json::from_str(&text).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    let named = |name: &str| {
        events
            .iter()
            .filter(|e| e["ph"] == "X" && e["name"] == name)
            .count()
    };
    assert_eq!(named("step"), 1, "one step on the trace");
    assert!(named("forward") > 0 && named("backward") > 0);
    assert!(named("update") > 0, "the step's expert updates are on it");
    // The host's own passes between kernel calls are named, a layer each.
    let layers = 2; // the tiny preset's
    for pass in [
        "router",
        "combine",
        "rmsnorm backward",
        "q, k, v: biases, norms, rope",
    ] {
        assert!(named(pass) >= layers, "{pass}: {}", named(pass));
    }
    assert!(events.iter().any(|e| e["cat"] == "host"));

    let o = out.to_str().unwrap();
    refused(
        &[
            "train",
            "--resume",
            "--out",
            o,
            "--timeline-step",
            "2",
            "--steps",
            "4",
        ],
        "--timeline-step 2: this run goes from step 4 to 4",
    );
}

/// A fine-tune says so on its first line (not "strata train").
#[test]
fn a_fine_tune_names_itself() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    write_checkpoint(&model, &tiny_config());
    let out = dir.path().join("run");
    let output = strata_bin()
        .args(["finetune", "--model", model.to_str().unwrap()])
        .args([
            "--out",
            out.to_str().unwrap(),
            "--steps",
            "1",
            "--seq-len",
            "8",
        ])
        .args(["--batch", "2", "--eval-every", "0", "--quiet"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.starts_with("strata finetune: "), "{stdout}");
}

/// Without --backend the run picks one and its first line says which and
/// what it found: the GPU where this binary has the cuda feature and the
/// driver (or CI's CPU model of it) sees one, else the cpu. A resumed run
/// keeps it, and an explicit --backend cpu is not second-guessed.
#[test]
fn the_first_line_names_the_backend_it_chose() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let first_line = |args: &[String]| {
        let run = strata_bin().args(args).output().unwrap();
        assert!(run.status.success(), "{run:?}");
        let stdout = String::from_utf8_lossy(&run.stdout).into_owned();
        stdout.lines().next().unwrap_or_default().to_string()
    };
    let line = first_line(&cli_args(&out, 2));
    let gpu = line.contains("backend cuda (auto: found ");
    let cpu = line.contains("backend cpu (auto: ");
    assert!(gpu != cpu, "{line}");
    if !cfg!(feature = "cuda") {
        assert!(line.contains("built without --features cuda"), "{line}");
    }
    let record = std::fs::read_to_string(out.join("run.json")).unwrap();
    let record: serde_json::Value = serde_json::from_str(&record).unwrap();
    let chosen = if gpu { "cuda" } else { "cpu" };
    assert_eq!(
        record["options"]["backend"], chosen,
        "run.json keeps the choice"
    );

    let mut resume = cli_args(&out, 3);
    resume.push("--resume".into());
    let line = first_line(&resume);
    assert!(
        line.contains(&format!("backend {chosen}")) && !line.contains("auto"),
        "{line}"
    );

    let mut cpu_args = cli_args(&dir.path().join("cpu"), 1);
    cpu_args.extend(["--backend", "cpu"].map(String::from));
    let line = first_line(&cpu_args);
    assert!(
        line.contains("backend cpu, expert GEMMs in bf16 ("),
        "{line}"
    );
    let mut f32_args = cli_args(&dir.path().join("cpu-f32"), 1);
    f32_args.extend(["--backend", "cpu", "--expert-gemm", "f32"].map(String::from));
    let line = first_line(&f32_args);
    assert!(line.ends_with("backend cpu"), "{line}");
}

/// On two compute threads the cpu says how it computes a layer's
/// experts: side by side where a group holds two a thread, else each
/// alone with its GEMMs split; a group never more than a layer's experts;
/// one thread says nothing of groups. The losses are the same bits.
#[test]
fn the_cpu_says_how_it_computes_a_group_of_experts() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        (
            "2",
            Some("4"),
            Some("up to 4 of a layer at a time, side by side on the compute threads"),
        ),
        (
            "2",
            Some("64"),
            Some("up to 8 of a layer at a time, side by side"),
        ),
        (
            "2",
            Some("2"),
            Some("up to 2 of a layer at a time, each computed alone"),
        ),
        ("1", None, None),
    ];
    let mut losses = Vec::new();
    for (i, (threads, group, said)) in cases.into_iter().enumerate() {
        let out = dir.path().join(format!("case-{i}"));
        let mut args: Vec<String> = [
            "train",
            "--preset",
            "tiny",
            "--steps",
            "2",
            "--seq-len",
            "16",
            "--batch",
            "4",
            "--compute-threads",
            threads,
            "--backend",
            "cpu",
            "--out",
        ]
        .map(String::from)
        .to_vec();
        args.push(out.to_str().unwrap().to_string());
        if let Some(g) = group {
            args.extend(["--expert-group".to_string(), g.to_string()]);
        }
        let run = strata_bin().args(&args).output().unwrap();
        assert!(run.status.success(), "{run:?}");
        let stdout = String::from_utf8_lossy(&run.stdout);
        let line = stdout.lines().find(|l| l.contains("experts: up to"));
        match said {
            Some(said) => assert!(line.is_some_and(|l| l.contains(said)), "{stdout}"),
            None => assert!(line.is_none(), "{stdout}"),
        }
        let log = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let loss: Vec<u64> = log
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter_map(|m| m["loss"].as_f64())
            .map(f64::to_bits)
            .collect();
        losses.push(loss);
    }
    assert!(!losses[0].is_empty());
    assert!(losses.windows(2).all(|w| w[0] == w[1]), "{losses:?}");
}

/// `--bf16-kernel` fixes the cpu's bf16 GEMM kernel for the run: its first
/// line names it and `run.json` keeps it; the portable, `vdpbf16ps` and
/// FMA kernels train the same bits; a kernel this CPU lacks, or a name
/// strata does not know, is refused before training.
#[test]
fn the_bf16_kernel_is_chosen_named_and_kept() {
    let dir = tempfile::tempdir().unwrap();
    let mut losses = Vec::new();
    for name in strata::backend::Bf16Kernel::ALL.map(strata::backend::Bf16Kernel::name) {
        let kernel = strata::backend::Bf16Kernel::from_name(name).unwrap();
        let out = dir.path().join(name);
        let mut args = cli_args(&out, 4);
        args.extend(["--backend", "cpu", "--bf16-kernel", name].map(String::from));
        let run = strata_bin().args(&args).output().unwrap();
        let stdout = String::from_utf8_lossy(&run.stdout);
        if !kernel.supported() {
            assert!(!run.status.success());
            let err = String::from_utf8_lossy(&run.stderr);
            let why = format!("this CPU cannot run the {name} kernel");
            assert!(err.contains(&why), "{err}");
            continue;
        }
        assert!(run.status.success(), "{run:?}");
        let first = stdout.lines().next().unwrap_or_default();
        assert!(
            first.contains(&format!("expert GEMMs in bf16 ({name})")),
            "{first}"
        );
        let record = std::fs::read_to_string(out.join("run.json")).unwrap();
        let record: serde_json::Value = serde_json::from_str(&record).unwrap();
        assert_eq!(record["options"]["bf16_kernel"], name);
        let log = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
        let loss: Vec<u32> = log
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter_map(|m| m["loss"].as_f64())
            .map(|l| (l as f32).to_bits())
            .collect();
        assert!(!loss.is_empty(), "{log}");
        losses.push((name, loss));
    }
    let same_order: Vec<_> = losses.iter().filter(|(k, _)| *k != "amx-bf16").collect();
    assert!(
        same_order.windows(2).all(|w| w[0].1 == w[1].1),
        "{losses:?}"
    );
    let mut args = cli_args(&dir.path().join("bogus"), 1);
    args.extend(["--bf16-kernel", "avx2"].map(String::from));
    let run = strata_bin().args(&args).output().unwrap();
    assert!(!run.status.success());
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        err.contains("give auto, amx-bf16, avx512-bf16, avx512-fma, avx2-fma or portable"),
        "{err}"
    );
}

/// Whether the cuda cases run on the CPU model of the driver, the only
/// one that can be given a size and reports its peak; else says why the
/// `what` case skips.
fn on_the_driver_model(what: &str) -> bool {
    if let Err(e) = strata::backend::BackendKind::Cuda.check(0..1, Dtype::Bf16) {
        common::cuda_case_skipped(e);
        return false;
    }
    let (_, found) = strata::backend::BackendKind::detect(1, Dtype::Bf16);
    if !found.contains("CPU model") {
        eprintln!("{what} case skipped: {found} is not the driver model");
        return false;
    }
    true
}

/// On a GPU, `strata plan`'s device memory (the dense params, gradient
/// and moments, the activations as `gpu_activation_bytes` counts them with
/// the largest workspace, the expert slots) holds what a run allocates:
/// the driver model's peak, at a short and a long sequence (where the
/// attention's blocks, not S², bound its workspace), stays within the
/// plan and above half of it. Only the driver model reports its peak
/// (`STRATA_FAKE_CUDA_PEAK`), so the case runs there.
#[test]
fn the_plan_holds_what_a_gpu_run_allocates() {
    if !on_the_driver_model("device plan") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let config = LmConfig::preset("tiny").unwrap();
    for (batch, seq_len, mib) in [(4usize, 64usize, 16u64), (2, 512, 64)] {
        let out = dir.path().join(format!("run-{seq_len}"));
        let peak_file = dir.path().join(format!("peak-{seq_len}"));
        let device_mem = mib << 20;
        let run = strata_bin()
            .args([
                "train",
                "--backend",
                "cuda",
                "--preset",
                "tiny",
                "--steps",
                "2",
            ])
            .args([
                "--batch",
                &batch.to_string(),
                "--seq-len",
                &seq_len.to_string(),
            ])
            .args(["--device-mem", &device_mem.to_string(), "--quiet", "--out"])
            .arg(&out)
            .env("STRATA_FAKE_CUDA_PEAK", &peak_file)
            .output()
            .unwrap();
        assert!(
            run.status.success(),
            "{}",
            String::from_utf8_lossy(&run.stderr)
        );
        let peak: u64 = std::fs::read_to_string(&peak_file)
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        let plan = trainer::plan::plan(&trainer::plan::PlanInput {
            model: &config,
            frozen_dense: 0,
            train_experts: true,
            compute_dtype: Dtype::Bf16,
            seq_len,
            batch,
            micro_batches: 1,
            devices: 1,
            ranks: 1,
            device_mem,
            host_mem: 1 << 40,
            store_dir: None,
            host_stream_slots: EngineConfig::default().host_stream_slots,
            host_cell_slots: 0,
            gpu: true,
            expert_group: None,
            dense_on_device: true,
            dense_gemm: Default::default(),
            expert_gemm: Default::default(),
            naive_schedule: false,
            compute_threads: 1,
        })
        .unwrap();
        let planned = plan.dense_device_bytes + plan.activation_bytes + plan.expert_device_bytes;
        let cpu_activations = trainer::plan::activation_bytes(&config, seq_len, batch);
        eprintln!(
            "cuda case: {batch} × {seq_len} tokens: peak {peak} bytes on the device, planned \
             {planned} (activations {} on the GPU, {cpu_activations} as the cpu keeps them)",
            plan.activation_bytes
        );
        assert!(peak <= planned, "{peak} > {planned}");
        assert!(2 * peak > planned, "{peak} is under half of {planned}");
    }
}

/// With `--backend cuda` and no `--device-mem`, a run takes 90 % of the
/// GPU's free memory and says so; a flag still wins. The driver model can
/// be given a size (`STRATA_FAKE_CUDA_MEMORY`), so the case runs there.
#[test]
fn device_memory_is_sized_from_the_gpu_unless_given() {
    if !on_the_driver_model("device memory") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, extra: &[&str]| {
        let out = strata_bin()
            .args([
                "train",
                "--backend",
                "cuda",
                "--preset",
                "tiny",
                "--steps",
                "1",
            ])
            .args(extra)
            .arg("--out")
            .arg(dir.path().join(name))
            .env("STRATA_FAKE_CUDA_MEMORY", (256u64 << 20).to_string())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{text}");
        text
    };
    let sized = run("sized", &[]);
    assert!(
        sized.contains("--device-mem 230.40 MiB: 90 % of the GPU's 256.00 MiB free"),
        "{sized}"
    );
    let given = run("given", &["--device-mem", "64MiB"]);
    assert!(!given.contains("of the GPU's"), "{given}");
}

/// A GPU that runs out of memory mid-run is named, with its free memory
/// and what to lower, rather than left as the driver's error code. Only
/// the CPU model of the driver can be given less memory
/// (`STRATA_FAKE_CUDA_MEMORY`), so the case runs there.
#[test]
fn a_gpu_out_of_memory_says_what_to_lower() {
    if !on_the_driver_model("out-of-memory") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let run = strata_bin()
        .args(["train", "--backend", "cuda", "--preset", "small"])
        .args(["--steps", "1", "--device-mem", "64MiB", "--out"])
        .arg(&out)
        .env("STRATA_FAKE_CUDA_MEMORY", (12u64 << 20).to_string())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(!run.status.success(), "{err}");
    assert!(err.contains("the GPU is out of memory"), "{err}");
    assert!(err.contains("of its 12582912 bytes are free"), "{err}");
    assert!(err.contains("lower --device-mem"), "{err}");
}
