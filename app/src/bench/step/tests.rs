//! `bench step`'s tests: refusals, scratch clean-up, and every
//! configuration on tiny stacks.

use super::*;

fn tiny() -> ModelConfig {
    ModelConfig {
        layers: 2,
        d_model: 16,
        d_ff: 32,
        experts: 8,
        classes: 8,
        ..ModelConfig::default()
    }
}

/// A shape whose four engines could not fit in any machine's memory is
/// refused before anything is allocated or written.
#[test]
fn a_stack_too_big_for_host_memory_is_refused_up_front() {
    if host_memory_available().is_none() {
        return eprintln!("skipped: this OS does not say how much memory is available");
    }
    let dir = tempfile::tempdir().unwrap();
    let config = StepBenchConfig {
        model: ModelConfig {
            d_model: 1 << 16,
            d_ff: 1 << 16, // 12.9 G params an expert
            ..tiny()
        },
        tokens: 32,
        balance_tokens: false,
        dir: dir.path().to_path_buf(),
        ..StepBenchConfig::default()
    };
    let err = run(&config, |_| {}).unwrap_err().to_string();
    assert!(
        err.contains("bench step keeps its 4 runs' engines at once"),
        "{err}"
    );
    assert!(err.contains("lower --d-model"), "{err}");
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// Too few host slots for the default compute cell and three streaming
/// record slots: refused in the bench's flags, with a host share that
/// would do, before any store is written.
#[test]
fn too_few_host_slots_beside_the_compute_cells_are_refused_in_flags() {
    let dir = tempfile::tempdir().unwrap();
    let config = StepBenchConfig {
        model: tiny(), // 16 records: a quarter is 4 host slots
        tokens: 32,
        balance_tokens: false,
        host_cell_slots: 2,
        dir: dir.path().to_path_buf(),
        ..StepBenchConfig::default()
    };
    let err = run(&config, |_| {}).unwrap_err().to_string();
    assert!(
        err.contains("--host-cell-slots 2 leaves 2 of them for records"),
        "{err}"
    );
    assert!(
        err.contains("raise --host-fraction to 0.32 or more"),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn scratch_left_by_a_dead_run_is_removed_and_a_live_ones_kept() {
    if !std::path::Path::new("/proc/self").exists() {
        return eprintln!("skipped: no /proc to tell live processes from dead ones");
    }
    let dir = tempfile::tempdir().unwrap();
    let dead = (4_000_000u32..)
        .find(|pid| !std::path::Path::new(&format!("/proc/{pid}")).exists())
        .unwrap();
    let named = |name: String| {
        let path = dir.path().join(name);
        std::fs::create_dir(&path).unwrap();
        std::fs::write(path.join("ew.store"), b"records").unwrap();
        path
    };
    let stale = named(format!("strata-bench-step-{dead}"));
    let live = named(format!("strata-bench-step-{}", std::process::id()));
    let other = named("strata-bench-step-notes".to_string());
    assert_eq!(remove_stale_scratch(dir.path()), vec![stale.clone()]);
    assert!(!stale.exists() && live.exists() && other.exists());
    assert!(remove_stale_scratch(dir.path()).is_empty());
}

#[test]
fn a_tiny_stack_runs_every_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let config = StepBenchConfig {
        model: tiny(),
        tokens: 32,
        balance_tokens: false,
        steps: 2,
        rounds: 2,
        dir: dir.path().to_path_buf(),
        ..StepBenchConfig::default()
    };
    let (records, summary) = run(&config, |_| {}).unwrap();
    let runs: Vec<_> = records.iter().map(|r| r.run).collect();
    assert_eq!(runs, ["expert_wise", "naive", "compute_only", "io_only"]);
    assert!(records.iter().all(|r| r.tokens_per_s > 0.0));
    // The SSD runs move records between host and SSD; compute-only does not.
    assert!(records[0].bytes_ssd_to_host > 0);
    assert_eq!(records[2].bytes_ssd_to_host, 0);
    // ...so their SSD is busy a while each step; compute-only's never is.
    for r in [&records[0], &records[1], &records[3]] {
        assert!(r.ssd_busy_s > 0.0, "{}", r.run);
    }
    assert_eq!(records[2].ssd_busy_s, 0.0);
    assert!(summary.expert_wise_over_naive > 0.0);
    assert_eq!(summary.rounds, 2);
    assert_eq!(summary.expert_wise_over_naive_by_round.len(), 2);
    assert!(records.iter().all(|r| r.steps == 4 && r.quiet_steps <= 4));
    assert_eq!(
        summary.quiet_expert_wise_over_naive.is_some(),
        records.iter().all(|r| r.quiet_steps > 0)
    );
    if cfg!(target_os = "linux") {
        assert!(records.iter().all(|r| r.steal_s.is_some_and(|s| s >= 0.0)));
    }
    let mut noisy = records[0].clone();
    (noisy.steal_s, noisy.step_s) = (Some(1.5), 1.5);
    assert_eq!(noisy.steal_share(2.0), Some(0.5));
    noisy.steal_s = None;
    assert_eq!(noisy.steal_share(2.0), None);
    // Every run computes something on this thread, so it uses CPU time.
    assert!(records.iter().all(|r| r.cpu_s.is_some_and(|c| c > 0.0)));
    if cfg!(target_os = "linux") {
        assert!(records
            .iter()
            .all(|r| r.page_faults.is_some_and(|f| f >= 0.0)));
    }
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    assert!(records
        .iter()
        .all(|r| r.devices == 1 && r.device_load_gap == 0.0));
}

/// A modeled device: every run but the I/O-only one sleeps its expert
/// compute, which the records and the summary say; it stands in for the
/// cpu backend only, and its rate must be a positive number.
#[test]
fn a_modeled_device_is_labeled_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let config = StepBenchConfig {
        model: tiny(),
        tokens: 32,
        balance_tokens: false,
        steps: 1,
        rounds: 1,
        modeled_device_flops: Some(1e9),
        dir: dir.path().to_path_buf(),
        ..StepBenchConfig::default()
    };
    let (records, summary) = run(&config, |_| {}).unwrap();
    let labels: Vec<_> = records.iter().map(|r| r.expert_compute).collect();
    assert_eq!(labels, ["modeled", "modeled", "modeled", "skipped"]);
    assert_eq!(summary.modeled_device_gflop_per_s, Some(1.0));
    // 6 FLOPs an expert parameter an assignment, over both layers, at
    // 1 GFLOP/s.
    let model = tiny();
    let slept = (6 * 32 * model.top_k * model.expert_params() * model.layers) as f64 / 1e9;
    assert!(records[2].compute_s >= slept, "{} s", records[2].compute_s);
    for (rate, backend, expected) in [
        (0.0, BackendKind::Cpu, "must be a positive number of FLOP/s"),
        (1e9, BackendKind::Cuda, "leave out --backend (cpu)"),
    ] {
        let config = StepBenchConfig {
            modeled_device_flops: Some(rate),
            backend,
            ..config.clone()
        };
        let err = run(&config, |_| {}).unwrap_err().to_string();
        assert!(err.contains(expected), "{err}");
    }
    let (records, summary) = run(
        &StepBenchConfig {
            modeled_device_flops: None,
            ..config
        },
        |_| {},
    )
    .unwrap();
    let labels: Vec<_> = records.iter().map(|r| r.expert_compute).collect();
    assert_eq!(labels, ["computed", "computed", "computed", "skipped"]);
    assert_eq!(summary.modeled_device_gflop_per_s, None);
}

/// Half the records in host memory and the engine's split (no compute
/// cells): 4 of 8 slots keep the last layer's experts 0–3, and its other 4
/// defer their updates unless told not to, in the expert-wise and I/O-only
/// runs alike (the naive one keeps nothing).
#[test]
fn deferred_updates_follow_the_config() {
    let dir = tempfile::tempdir().unwrap();
    let half = StepBenchConfig {
        model: tiny(),
        tokens: 32,
        balance_tokens: false,
        host_fraction: 0.5,
        steps: 1,
        rounds: 1,
        dir: dir.path().to_path_buf(),
        ..StepBenchConfig::default()
    };
    for (defer, expected) in [(true, 4), (false, 0)] {
        let config = StepBenchConfig {
            host_stream_slots: Some(4),
            host_cell_slots: 0,
            defer_updates: defer,
            ..half.clone()
        };
        let (records, _) = run(&config, |_| {}).unwrap();
        let deferred: Vec<_> = records.iter().map(|r| r.deferred_updates).collect();
        assert_eq!(deferred, [expected, 0, 0, expected], "defer {defer}");
        assert_eq!(records[0].host_kept, 4);
    }
    // 5 streaming slots and no cells, so 3 kept: the last layer's other 5
    // held.
    let no_cells = StepBenchConfig {
        host_cell_slots: 0,
        ..half.clone()
    };
    let (records, _) = run(&no_cells, |_| {}).unwrap();
    let deferred: Vec<_> = records.iter().map(|r| r.deferred_updates).collect();
    assert_eq!(deferred, [5, 0, 0, 5]);
    assert_eq!((records[0].host_kept, records[0].host_cells), (3, 0));
    // The bench's own split: one slot in compute cells, 5 of the 7 left
    // streaming, so 2 kept; the last layer's other 6 do not fit the
    // streaming slots and update in the backward.
    let (records, _) = run(&half, |_| {}).unwrap();
    let deferred: Vec<_> = records.iter().map(|r| r.deferred_updates).collect();
    assert_eq!(deferred, [0, 0, 0, 0]);
    assert_eq!((records[0].host_slots, records[0].host_kept), (7, 2));
    assert!(records[0].host_cells > 0);
    // Neither the naive run nor the all-resident one has cells.
    assert_eq!((records[1].host_cells, records[2].host_cells), (0, 0));
}

/// With `--backend cuda`, wherever a CUDA device answers (a GPU, or
/// the CPU model of one in CI): every configuration runs, on the GPUs.
#[cfg(feature = "cuda")]
#[test]
fn a_tiny_stack_runs_every_configuration_on_gpus() {
    if let Err(e) = BackendKind::Cuda.check(0..2, Dtype::Bf16) {
        crate::bench::cuda_case_skipped(e);
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for devices in [1, 2] {
        let config = StepBenchConfig {
            model: tiny(),
            tokens: 64,
            balance_tokens: false,
            steps: 2,
            devices,
            device_experts: 4,
            backend: BackendKind::Cuda,
            dir: dir.path().to_path_buf(),
            ..StepBenchConfig::default()
        };
        let (records, summary) = run(&config, |_| {}).unwrap();
        assert!(records
            .iter()
            .all(|r| r.backend == "cuda" && r.devices == devices && r.tokens_per_s > 0.0));
        assert!(summary.expert_wise_over_naive > 0.0);
        eprintln!("cuda case: bench step on {devices} GPU(s) ran every configuration");
    }
}

#[test]
fn balanced_tokens_are_found_first_and_every_run_uses_them() {
    let dir = tempfile::tempdir().unwrap();
    let config = StepBenchConfig {
        model: tiny(),
        tokens: 32,
        steps: 1,
        rounds: 1,
        dir: dir.path().to_path_buf(),
        ..StepBenchConfig::default()
    };
    assert!(config.balance_tokens, "the default balances");
    let mut lines = Vec::new();
    let (records, summary) = run(&config, |l| lines.push(l.to_string())).unwrap();
    let balance = summary.balance.expect("balanced");
    assert_eq!(summary.tokens, balance.tokens);
    assert!(records.iter().all(|r| r.tokens == balance.tokens));
    assert!(balance.tokens % balance::TOKENS_GRAIN == 0);
    assert!((16..=32 * balance::SEARCH_FACTOR_MAX).contains(&balance.tokens));
    assert!(balance.io_only_s > 0.0);
    let (first, _) = balance.compute_only_s[0];
    assert_eq!(first, 32, "the search starts at the given count");
    // Each count tried is twice or half the one before it.
    for pair in balance.compute_only_s.windows(2) {
        let (a, b) = (pair[0].0, pair[1].0);
        assert!(b == 2 * a || 2 * b == a, "{a} then {b}");
    }
    // Both runs were timed at every count tried.
    let counts = |v: &[(usize, f64)]| v.iter().map(|p| p.0).collect::<Vec<_>>();
    assert_eq!(counts(&balance.compute_only_s), counts(&balance.io_only_at));
    if balance.unbracketed.is_none() {
        let excess = balance
            .compute_only_s
            .iter()
            .zip(&balance.io_only_at)
            .map(|(c, io)| c.1 - io.1);
        let below = excess.clone().any(|e| e <= 0.0);
        let above = excess.clone().any(|e| e > 0.0);
        assert!(below && above, "{balance:?}");
        // The I/O-only step at the balance lies between those timed.
        let ios = balance.io_only_at.iter().map(|p| p.1);
        let (lo, hi) = ios.fold((f64::MAX, 0.0f64), |(a, b), s| (a.min(s), b.max(s)));
        assert!((lo..=hi).contains(&balance.io_only_s), "{balance:?}");
    }
    assert!(lines.iter().any(|l| l.starts_with("balance: ")));
    // The probes are not counted as the runs' timed steps.
    assert!(records.iter().all(|r| r.steps == 1));
}

#[test]
fn several_devices_run_every_configuration() {
    let dir = tempfile::tempdir().unwrap();
    let config = StepBenchConfig {
        model: tiny(),
        tokens: 64,
        balance_tokens: false,
        steps: 2,
        devices: 2,
        device_experts: 4,
        dir: dir.path().to_path_buf(),
        ..StepBenchConfig::default()
    };
    let (records, _) = run(&config, |_| {}).unwrap();
    assert!(records
        .iter()
        .all(|r| r.devices == 2 && r.tokens_per_s > 0.0 && !r.device_load_gap.is_nan()));
}
