//! `strata bench upload`: host → GPU bandwidth of expert uploads through
//! the GPU device tier (page-locked host memory, the upload stream, one
//! event per copy), per expert size, against one large plain pinned memcpy
//! measured in the same run; and the same uploads from memory that is not
//! page-locked, staged through two page-locked buffers (what runs when the
//! memlock limit refuses page-locking). Needs the `cuda` feature and a GPU.

use serde::Serialize;

#[derive(Clone, Debug, Serialize)]
pub struct UploadRecord {
    pub bench: &'static str,
    pub gpu: String,
    pub expert_bytes: usize,
    /// Experts uploaded per timed repetition (round-robin over 4 slots).
    pub experts: usize,
    /// Median over repetitions.
    pub upload_gb_per_s: f64,
    /// One `plain_bytes` pinned memcpy, median over the same repetitions.
    pub plain_gb_per_s: f64,
    pub plain_bytes: usize,
    pub ratio: f64,
    /// Whether the host source was page-locked (registered with the driver).
    pub page_locked: bool,
    /// The same uploads from memory that is not page-locked, through two
    /// page-locked staging buffers (median over the same repetitions).
    pub staged_gb_per_s: f64,
}

/// Expert sizes measured by default: a small expert to MoE-L's bf16 one.
pub const DEFAULT_SIZES: [usize; 4] = [2 << 20, 8 << 20, 32 << 20, 64 << 20];

#[cfg(not(feature = "cuda"))]
pub fn run(
    _reps: usize,
    _sizes: &[usize],
    _progress: impl FnMut(&str),
) -> Result<Vec<UploadRecord>, String> {
    Err(
        "this strata was built without the cuda feature: on a machine with an NVIDIA \
         driver, build it with `cargo build --release --features cuda`"
            .into(),
    )
}

#[cfg(feature = "cuda")]
pub fn run(
    reps: usize,
    sizes: &[usize],
    mut progress: impl FnMut(&str),
) -> Result<Vec<UploadRecord>, String> {
    use std::sync::Arc;
    use std::time::Instant;

    use strata_tiers::device_cuda::{open_gpu, register_host, CudaDeviceArena, PlainCopy};
    use strata_tiers::io::{AlignedBuf, HostRegion, SharedRegion};
    use strata_tiers::{DeviceArena, HostBytes};

    use super::Timing;

    /// One host source lent to many uploads.
    struct Lent(Arc<SharedRegion>);
    impl HostBytes for Lent {
        fn bytes(&self) -> &[u8] {
            self.0.as_slice()
        }
    }
    let shared = |bytes: usize| {
        Arc::new(HostRegion::new(AlignedBuf::zeroed(bytes), false, None).into_shared())
    };

    if reps == 0 || sizes.is_empty() {
        return Err("--reps and the sizes must be at least 1".into());
    }
    let (ctx, info) = open_gpu(0).map_err(|e| e.to_string())?;
    progress(&format!("{} ({} bytes)", info.name, info.total_bytes));
    let plain = PlainCopy::new(&ctx, 256 << 20).map_err(|e| e.to_string())?;
    let mut records = Vec::new();
    for &size in sizes {
        let arena = CudaDeviceArena::new(Arc::clone(&ctx), 4 * size as u64, size)
            .map_err(|e| e.to_string())?;
        let mut staged_arena = CudaDeviceArena::new(Arc::clone(&ctx), 4 * size as u64, size)
            .map_err(|e| e.to_string())?;
        staged_arena.stage_uploads(2).map_err(|e| e.to_string())?;
        let pageable = shared(size);
        let experts = (plain.bytes() / size).clamp(4, 64);
        let src = shared(size);
        let registration = register_host(&ctx, src.lease());
        if let Err(e) = &registration {
            progress(&e.to_string());
        }
        let mut upload = Vec::with_capacity(reps);
        let mut staged = Vec::with_capacity(reps);
        let mut plain_times = Vec::with_capacity(reps);
        let time_uploads = |arena: &CudaDeviceArena, src: &Arc<SharedRegion>| {
            let t0 = Instant::now();
            let events = (0..experts)
                .map(|i| arena.upload_htod(i % 4, Box::new(Lent(Arc::clone(src)))))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| e.to_string())?;
            for e in &events {
                e.wait().map_err(|e| e.to_string())?;
            }
            Ok::<_, String>(t0.elapsed())
        };
        for _ in 0..reps {
            upload.push(time_uploads(&arena, &src)?);
            staged.push(time_uploads(&staged_arena, &pageable)?);
            let t0 = Instant::now();
            plain.run().map_err(|e| e.to_string())?;
            plain_times.push(t0.elapsed());
        }
        let up = (experts * size) as f64 / Timing::of(&upload).median_s / 1e9;
        let pl = plain.bytes() as f64 / Timing::of(&plain_times).median_s / 1e9;
        let st = (experts * size) as f64 / Timing::of(&staged).median_s / 1e9;
        records.push(UploadRecord {
            bench: "upload",
            gpu: info.name.clone(),
            expert_bytes: size,
            experts,
            upload_gb_per_s: up,
            plain_gb_per_s: pl,
            plain_bytes: plain.bytes(),
            ratio: up / pl,
            page_locked: registration.is_ok(),
            staged_gb_per_s: st,
        });
        drop(arena);
        drop(staged_arena);
        drop(registration);
    }
    Ok(records)
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    /// Wherever a CUDA device answers (a GPU, or the CPU model of one in
    /// CI), the bench runs: direct and staged uploads, the plain copy.
    #[test]
    fn the_bench_runs_where_a_cuda_device_answers() {
        if let Err(e) = strata::backend::BackendKind::Cuda.check(0..1, strata_tiers::Dtype::Bf16) {
            crate::bench::cuda_case_skipped(e);
            return;
        }
        let records = super::run(2, &[1 << 20, 3 << 20], |_| {}).unwrap();
        assert_eq!(records.len(), 2);
        for r in &records {
            assert!(r.upload_gb_per_s > 0.0 && r.plain_gb_per_s > 0.0 && r.staged_gb_per_s > 0.0);
            assert!(r.experts >= 4 && r.ratio > 0.0);
        }
        eprintln!("cuda case: bench upload ran on {}", records[0].gpu);
    }
}
