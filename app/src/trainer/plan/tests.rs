use super::test_input as input;
use super::*;
use strata::engine::{AvailableMemory, MemoryBound};

/// The engine's own count of the gradients it holds: a layer's
/// updates in flight and a group computing; every expert's where
/// micro-batches sum them or the naive schedule holds them; on a GPU,
/// one at a time and its download buffers. On the cpu the device's
/// share, the workspace of each compute thread and the gradients sum
/// to the host memory in all.
#[test]
fn the_expert_gradients_and_the_cpu_s_workspace_are_counted() {
    let m = LmConfig::preset("tiny").unwrap(); // 2 layers of 8 experts
    let with = |group, micro_batches, naive_schedule, gpu| {
        plan(&PlanInput {
            expert_group: Some(group),
            micro_batches,
            naive_schedule,
            gpu,
            ..input(&m, 1 << 30, 1 << 30)
        })
        .unwrap()
    };
    let buffers = |p: &MemoryPlan| p.gradient_buffers;
    assert_eq!(buffers(&with(1, 1, false, false)), 8 + 1);
    assert_eq!(buffers(&with(3, 1, false, false)), 8 + 3);
    assert_eq!(buffers(&with(64, 1, false, false)), 8 + 8);
    assert_eq!(buffers(&with(3, 2, false, false)), 16 + 3);
    assert_eq!(buffers(&with(3, 1, true, false)), 16 + 3);
    let gpu = with(1, 1, false, true);
    let downloads = strata::backend::GRADIENT_DOWNLOAD_BUFFERS as u64;
    assert_eq!(buffers(&gpu), 8 + 1 + downloads);
    assert_eq!((gpu.cpu_workspace_bytes, gpu.host_in_all()), (None, None));
    let p = with(1, 1, false, false);
    assert_eq!(p.gradient_bytes, 9 * 4 * m.expert_params() as u64);
    let workspace = p.cpu_workspace_bytes.unwrap();
    assert_eq!(
        p.host_in_all(),
        Some(
            p.dense_device_bytes
                + p.activation_bytes
                + p.expert_device_bytes
                + workspace
                + p.dense_host_bytes
                + p.expert_host_bytes
                + p.gradient_bytes
                + p.data_bytes
        )
    );
    // 4096 shuffled and 64 held-out sequences of 65 tokens, a u32 and
    // two bytes each.
    assert_eq!(p.data_bytes, (4096 + 64) * 65 * 6);
    // Each compute thread has its own buffers for an expert's FFN,
    // for every token at most (512 here): h, the sigmoid, dh, da, db.
    let two = plan(&PlanInput {
        compute_threads: 2,
        expert_group: Some(1),
        ..input(&m, 1 << 30, 1 << 30)
    })
    .unwrap();
    let per_thread = two.cpu_workspace_bytes.unwrap() - workspace;
    assert!(per_thread > 5 * 512 * 128 * 4, "{per_thread}");
    let text = p.describe();
    assert!(
        text.contains("for up to 9 expert gradients on their way to the optimizer"),
        "{text}"
    );
    assert!(text.contains("in all: "), "{text}");
    let all = p.host_in_all().unwrap();
    let machine = |bytes| AvailableMemory {
        bytes,
        bound: MemoryBound::Machine,
    };
    assert_eq!(p.check_host_memory(Some(&machine(all))), Ok(()));
    assert_eq!(p.check_host_memory(None), Ok(()));
    let err = p.check_host_memory(Some(&machine(all - 1024))).unwrap_err();
    assert!(err.contains("but this machine has"), "{err}");
    assert!(err.contains(": 1.00 KiB short. Lower --host-mem"), "{err}");
    let cgroup = AvailableMemory {
        bytes: all - 1024,
        bound: MemoryBound::Cgroup {
            path: "/job".into(),
            limit: all,
            in_use: 1024,
        },
    };
    let err = p.check_host_memory(Some(&cgroup)).unwrap_err();
    assert!(
        err.contains("but this process's memory cgroup (/job)"),
        "{err}"
    );
    assert_eq!(gpu.check_host_memory(Some(&machine(0))), Ok(()));
}

#[test]
fn the_host_slots_split_into_kept_streaming_and_cells() {
    let m = LmConfig::preset("tiny").unwrap();
    let p = plan(&input(&m, 1 << 30, 1 << 30)).unwrap();
    let record = p.expert_host_bytes / p.host_slots;
    let six = p.dense_host_bytes + 6 * record;
    let with = |stream: Option<usize>, cells: usize| {
        plan(&PlanInput {
            host_stream_slots: stream,
            host_cell_slots: cells,
            ..input(&m, 1 << 30, six)
        })
    };
    let p = with(Some(4), 1).unwrap();
    assert_eq!((p.host_slots, p.host_cell_slots, p.host_kept), (6, 1, 1));
    assert!(
        p.describe()
            .contains("(1 kept resident, 4 streaming, 1 in compute cells)"),
        "{}",
        p.describe()
    );
    let p = with(None, 2).unwrap();
    assert_eq!((p.host_cell_slots, p.host_kept), (2, 0));
    assert!(
        p.describe().contains("(2 in compute cells)"),
        "{}",
        p.describe()
    );
    let err = with(Some(4), 4).unwrap_err();
    assert!(
        err.contains("--host-cell-slots 4 leaves 2 of the 6 host slots"),
        "{err}"
    );
    // Where every record fits, nothing streams and nothing is split.
    let p = plan(&PlanInput {
        host_cell_slots: 3,
        ..input(&m, 1 << 30, 1 << 30)
    })
    .unwrap();
    assert_eq!((p.host_cell_slots, p.host_kept), (0, 0));
}

#[test]
fn modes_follow_the_budgets() {
    let m = LmConfig::preset("tiny").unwrap();
    let p = plan(&input(&m, 1 << 30, 1 << 30)).unwrap();
    assert_eq!(p.mode, OffloadMode::AllOnDevice);
    let fixed = p.dense_device_bytes + p.activation_bytes;
    let slot = 2 * m.expert_params() as u64;
    let p = plan(&input(&m, fixed + 3 * slot, 1 << 30)).unwrap();
    assert_eq!((p.mode, p.device_slots), (OffloadMode::HostOffload, 3));
    let p = plan(&input(
        &m,
        fixed + 3 * slot,
        p.dense_host_bytes + 5 * (1 << 20),
    ))
    .unwrap();
    assert_eq!(p.mode, OffloadMode::HostAndSsd);
    assert!(p.host_slots >= 2 && p.host_slots < p.expert_count);
    assert!(p.describe().contains("host + SSD"));
    // Past 4 host slots, the others keep records resident on one
    // device; with two devices every slot streams.
    assert!(p.host_slots > 4, "{}", p.describe());
    assert_eq!(p.host_kept, p.host_slots - 4);
    let kept = format!("({} kept resident, 4 streaming)", p.host_kept);
    assert!(p.describe().contains(&kept), "{}", p.describe());
    // Every expert on the device, but not every record in host memory:
    // the records stream from the SSD for their updates, and the mode
    // says so.
    let few_records = p.dense_host_bytes + 5 * (1 << 20);
    let p = plan(&input(&m, 1 << 30, few_records)).unwrap();
    assert_eq!(p.device_slots, p.expert_count);
    assert_eq!(p.mode, OffloadMode::HostAndSsd, "{}", p.describe());
    let host_mem = p.dense_host_bytes + 5 * (1 << 20);
    let two = |device_mem, host_mem| {
        plan(&PlanInput {
            devices: 2,
            ..input(&m, device_mem, host_mem)
        })
        .unwrap()
    };
    let roomy = two(1 << 30, 1 << 30);
    let fixed_two = roomy.dense_device_bytes + roomy.activation_bytes;
    let two = two(fixed_two + 3 * slot, host_mem);
    assert_eq!((two.mode, two.host_kept), (OffloadMode::HostAndSsd, 0));
    assert!(!two.describe().contains("kept"), "{}", two.describe());
}

#[test]
fn each_device_holds_its_share_of_the_activations() {
    let m = LmConfig::preset("tiny").unwrap();
    let one = plan(&input(&m, 1 << 30, 1 << 30)).unwrap();
    let two = plan(&PlanInput {
        devices: 2,
        ..input(&m, 1 << 30, 1 << 30)
    })
    .unwrap();
    assert_eq!(two.devices, 2);
    assert_eq!(2 * two.activation_bytes, one.activation_bytes);
    assert!(
        two.describe().contains("each of 2 devices"),
        "{}",
        two.describe()
    );
}

#[test]
fn refusals_name_the_shortfall() {
    let m = LmConfig::preset("moe-l").unwrap();
    let err = plan(&input(&m, 1 << 30, 1 << 40)).unwrap_err();
    assert!(
        err.contains("--device-mem") && err.contains("short"),
        "{err}"
    );
    let err = plan(&input(&m, 1 << 40, 1 << 30)).unwrap_err();
    assert!(err.contains("--host-mem") && err.contains("short"), "{err}");
}

/// On a GPU, a micro-batch whose kernels would run over more values
/// than a 32-bit thread index reaches is refused by name, whatever
/// memory there is; more micro-batches bring it back in reach.
#[test]
fn a_micro_batch_past_the_kernels_reach_is_refused() {
    let m = LmConfig::preset("moe-s").unwrap();
    let huge = |micro_batches| PlanInput {
        gpu: true,
        expert_group: None,
        seq_len: 4096,
        batch: 1024,
        micro_batches,
        ..input(&m, 1 << 50, 1 << 50)
    };
    let err = plan(&huge(1)).unwrap_err();
    assert!(
        err.contains("32-bit") && err.contains("--micro-batches"),
        "{err}"
    );
    assert!(plan(&huge(64)).is_ok());
    assert!(plan(&PlanInput {
        gpu: false,
        expert_group: None,
        ..huge(1)
    })
    .is_ok());
}

/// At a long sequence the attention keeps two values a query row and
/// head, on the cpu as on a GPU (whose workspace its blocks bound), not
/// its (S × S) probabilities: from 8192 to 16 384 tokens a sequence,
/// what either counts about doubles, where the probabilities alone
/// would grow fourfold.
#[test]
fn the_attention_keeps_no_probabilities() {
    let m = LmConfig::preset("moe-s").unwrap();
    let gpu = |m: &LmConfig, s, n| gpu_activation_bytes(m, s, n, 1);
    for count in [activation_bytes, gpu] {
        let (once, twice) = (count(&m, 8192, 1), count(&m, 16384, 1));
        assert!(twice < 3 * once, "{twice} {once}");
        let probs = (m.layers * m.heads * 8192 * 8192 * 4) as u64;
        assert!(once < probs, "{once} {probs}");
    }
}

/// Stepped on one GPU, the dense params' moments take device memory
/// (8 bytes a trainable param) besides params and gradient; several
/// devices step them on the host, and on the cpu reduce the gradient in
/// buckets, which holds a copy of it.
#[test]
fn moments_stepped_on_the_gpu_count_on_the_device() {
    let m = LmConfig::preset("tiny").unwrap();
    let frozen = 1000;
    let on = |devices, dense_on_device| PlanInput {
        devices,
        ranks: 1,
        dense_on_device,
        frozen_dense: frozen,
        ..input(&m, 1 << 30, 1 << 30)
    };
    let dense = m.dense_params() as u64;
    let host = plan(&on(1, false)).unwrap();
    let gpu = plan(&on(1, true)).unwrap();
    assert_eq!(host.dense_device_bytes, 8 * dense);
    assert_eq!(gpu.dense_device_bytes, 8 * dense + 8 * (dense - frozen));
    assert!(gpu.device_slots <= host.device_slots);
    // Two cpu devices, or two ranks, keep a copy of the gradient on its
    // way to the all-reduce beside the backward.
    let two = plan(&on(2, true)).unwrap();
    assert_eq!(two.dense_device_bytes, 12 * dense);
    let ranks = plan(&PlanInput {
        ranks: 2,
        ..on(1, false)
    })
    .unwrap();
    assert_eq!(ranks.dense_device_bytes, 12 * dense);
}

/// On one GPU the activations hold a group of experts' rows and two
/// groups' gradients: as many as a layer has (the default for tiny's
/// small experts), fewer where memory is tight rather than refusing,
/// one where a group of two would not leave four slots, and one on the
/// cpu or on several GPUs; `--expert-group` asks for fewer.
#[test]
fn a_gpu_plan_counts_the_largest_group_that_fits() {
    let m = LmConfig::preset("tiny").unwrap();
    let gpu = |device_mem, devices, expert_group| PlanInput {
        gpu: true,
        devices,
        expert_group,
        ..input(&m, device_mem, 1 << 30)
    };
    let roomy = plan(&gpu(1 << 30, 1, None)).unwrap();
    assert_eq!(roomy.expert_group, m.experts);
    assert_eq!(plan(&gpu(1 << 30, 1, Some(3))).unwrap().expert_group, 3);
    assert_eq!(plan(&gpu(1 << 30, 2, None)).unwrap().expert_group, 1);
    let cpu = PlanInput {
        expert_group: Some(4),
        ..input(&m, 1 << 30, 1 << 30)
    };
    assert_eq!(plan(&cpu).unwrap().expert_group, 1);
    // The least memory one expert at a time runs in (two slots): a
    // group of two needs more, so the plan takes one.
    let one = plan(&gpu(1 << 30, 1, Some(1))).unwrap();
    let slot = roomy.expert_device_bytes / roomy.device_slots;
    let least = one.dense_device_bytes + one.activation_bytes + 2 * slot;
    let tight = plan(&gpu(least, 1, None)).unwrap();
    assert_eq!((tight.expert_group, tight.device_slots), (1, 2));
    assert!(one.activation_bytes < roomy.activation_bytes);
}

/// On a GPU, bf16 dense GEMMs keep a bf16 copy of each weight: 2 bytes
/// a dense param more than f32 GEMMs; on the cpu neither counts.
#[test]
fn bf16_weight_copies_count_on_a_gpu() {
    let m = LmConfig::preset("tiny").unwrap();
    let on = |gpu, dense_gemm| PlanInput {
        gpu,
        dense_gemm,
        ..input(&m, 1 << 30, 1 << 30)
    };
    let dense = m.dense_params() as u64;
    let bf16 = plan(&on(true, DenseGemm::Bf16)).unwrap();
    let f32 = plan(&on(true, DenseGemm::F32)).unwrap();
    assert_eq!(bf16.dense_device_bytes, f32.dense_device_bytes + 2 * dense);
    let cpu = plan(&on(false, DenseGemm::Bf16)).unwrap();
    assert_eq!(cpu.dense_device_bytes, 8 * dense);
}

/// A new run needs the whole store on disk; a resume only what its
/// store lacks, and the refusal says so (a resume is not told to choose
/// another --out).
#[test]
fn a_resume_needs_only_the_disk_its_store_lacks() {
    // moe-l with 256 experts a layer: a store of about 5 TB.
    let m = LmConfig {
        experts: 256,
        ..LmConfig::preset("moe-l").unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let full = plan(&input(&m, 1 << 40, 1 << 43)).unwrap().ssd_bytes;
    let free = free_bytes(dir.path()).unwrap();
    assert!(full > free, "{free} bytes free hold the whole store");
    let here = PlanInput {
        store_dir: Some(dir.path()),
        ..input(&m, 1 << 40, 1 << 43)
    };
    let err = plan(&here).unwrap_err();
    assert!(err.contains("more on disk"), "{err}");
    assert!(
        err.contains("Free space there, or (for a new run)"),
        "{err}"
    );
    // The store of a run being resumed (sparse: its length is what counts).
    std::fs::File::create(dir.path().join("experts.strata"))
        .unwrap()
        .set_len(full)
        .unwrap();
    let p = plan(&here).unwrap();
    assert_eq!(p.ssd_bytes, full);
}

#[test]
fn the_free_space_of_a_real_directory_is_known() {
    let dir = tempfile::tempdir().unwrap();
    assert!(free_bytes(dir.path()).unwrap() > 0);
    assert!(free_bytes(&dir.path().join("not/yet")).unwrap() > 0);
}
