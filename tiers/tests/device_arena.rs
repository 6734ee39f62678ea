//! The device tier's contract, written once and run per backend: `cpu`
//! always; `cuda` (direct uploads) and `cuda_staged` (uploads through
//! page-locked staging buffers) when built with `--features cuda`,
//! skipping with the reason printed when no GPU (or no driver) is present.

use strata_tiers::{CpuDeviceArena, DeviceArena, TierError};

/// Makes an arena of `budget` bytes in slots of `slot` bytes.
type MakeArena<'a> = &'a dyn Fn(u64, usize) -> Result<Box<dyn DeviceArena>, TierError>;

/// Stamps `$body` (a `fn(MakeArena)`) as a test per backend.
macro_rules! per_backend {
    ($name:ident, $body:expr) => {
        mod $name {
            use super::*;

            #[test]
            fn cpu() {
                let body: fn(MakeArena) = $body;
                body(&|budget, slot| Ok(Box::new(CpuDeviceArena::new(budget, slot, 8)?)));
            }

            #[cfg(feature = "cuda")]
            #[test]
            fn cuda() {
                use strata_tiers::device_cuda::{open_gpu, CudaDeviceArena};
                let body: fn(MakeArena) = $body;
                match open_gpu(0) {
                    Err(e) => cuda_case_skipped(e),
                    Ok((ctx, info)) => {
                        eprintln!("cuda case on {} ({} bytes)", info.name, info.total_bytes);
                        body(&move |budget, slot| {
                            Ok(Box::new(CudaDeviceArena::new(ctx.clone(), budget, slot)?))
                        });
                    }
                }
            }

            // Uploads through page-locked staging buffers (as when the
            // host tier's memory could not be page-locked).
            #[cfg(feature = "cuda")]
            #[test]
            fn cuda_staged() {
                use strata_tiers::device_cuda::{open_gpu, CudaDeviceArena};
                let body: fn(MakeArena) = $body;
                match open_gpu(0) {
                    Err(e) => cuda_case_skipped(e),
                    Ok((ctx, _)) => body(&move |budget, slot| {
                        let mut arena = CudaDeviceArena::new(ctx.clone(), budget, slot)?;
                        arena.stage_uploads(2)?;
                        assert!(arena.is_staging());
                        Ok(Box::new(arena))
                    }),
                }
            }

            #[cfg(not(feature = "cuda"))]
            #[test]
            fn cuda() {
                cuda_case_skipped("built without --features cuda");
            }
        }
    };
}

fn pattern(slot: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| ((i * 7 + slot * 31) % 251) as u8)
        .collect()
}

per_backend!(every_slot_round_trips, |make| {
    let slot_bytes = 64 << 10;
    let arena = make(5 * slot_bytes as u64 + 100, slot_bytes).unwrap();
    assert_eq!(arena.slot_count(), 5);
    assert_eq!(arena.slot_bytes(), slot_bytes);
    // Every upload in flight at once, then every download.
    let events: Vec<_> = (0..5)
        .map(|s| {
            arena
                .upload_htod(s, Box::new(pattern(s, slot_bytes)))
                .unwrap()
        })
        .collect();
    for e in &events {
        e.wait().unwrap();
        assert!(e.is_complete());
    }
    let downloads: Vec<_> = (0..5)
        .map(|s| {
            arena
                .download_dtoh(s, Box::new(vec![0u8; slot_bytes]))
                .unwrap()
        })
        .collect();
    for (s, d) in downloads.into_iter().enumerate() {
        let mut back = d.wait().unwrap();
        assert!(back.bytes_mut() == &pattern(s, slot_bytes)[..], "slot {s}");
    }
});

per_backend!(copies_into_one_slot_run_in_order, |make| {
    let arena = make(2 * 4096, 4096).unwrap();
    let mut last = None;
    for round in 0..20usize {
        last = Some(
            arena
                .upload_htod(1, Box::new(pattern(round, 4096)))
                .unwrap(),
        );
    }
    last.unwrap().wait().unwrap();
    let mut back = arena
        .download_dtoh(1, Box::new(vec![0u8; 4096]))
        .unwrap()
        .wait()
        .unwrap();
    assert!(back.bytes_mut() == &pattern(19, 4096)[..]);
});

per_backend!(bad_requests_are_clear_errors, |make| {
    let err = make(100, 4096).err().unwrap();
    assert!(
        matches!(err, TierError::BudgetTooSmall { tier: "device", .. }),
        "{err}"
    );
    let arena = make(4096, 4096).unwrap();
    let err = arena
        .upload_htod(0, Box::new(vec![0u8; 5000]))
        .err()
        .unwrap();
    assert!(err.to_string().contains("5000"), "{err}");
    let err = arena.upload_htod(1, Box::new(vec![0u8; 5])).err().unwrap();
    assert!(err.to_string().contains("no device slot 1"), "{err}");
});

/// GPU slots start on `SLOT_ALIGN` boundaries whatever the slot size (so
/// cuBLAS sees an expert's weights equally aligned in every slot), and the
/// budget still counts unpadded slots.
#[cfg(feature = "cuda")]
#[test]
fn cuda_slots_start_aligned() {
    use strata_tiers::device_cuda::{open_gpu, CudaDeviceArena, SLOT_ALIGN};
    let (ctx, _) = match open_gpu(0) {
        Err(e) => return cuda_case_skipped(e),
        Ok(gpu) => gpu,
    };
    let slot = 3 * 1000 + 2; // bf16 params of an odd-sized expert
    let arena = CudaDeviceArena::new(ctx, 3 * slot as u64, slot).unwrap();
    assert_eq!(arena.slot_count(), 3);
    for i in 0..3 {
        assert_eq!(arena.slot_ptr(i) % SLOT_ALIGN as u64, 0, "slot {i}");
    }
    assert!(arena.slot_ptr(1) - arena.slot_ptr(0) >= slot as u64);
}

/// A GPU past the last one the driver sees is refused with how many it
/// sees and what to ask for instead.
#[cfg(feature = "cuda")]
#[test]
fn a_gpu_past_the_last_is_refused_with_the_count() {
    use strata_tiers::device_cuda::open_gpu;
    if let Err(e) = open_gpu(0) {
        return cuda_case_skipped(e);
    }
    let beyond = 64; // more than any machine strata runs on
    let err = open_gpu(beyond).unwrap_err().to_string();
    assert!(
        err.contains(&format!(
            "GPU {beyond} was asked for, but the CUDA driver sees"
        )) && err.contains("ask for at most"),
        "{err}"
    );
}

/// Says why a case that needs CUDA (a GPU, or the CPU model of one, with
/// NVRTC and ptxas) could not run. Where CUDA is expected, as in CI's
/// driver-model block, `STRATA_REQUIRE_CUDA=1` makes that a failure
/// instead of a skip that `cargo test` would show as a pass.
fn cuda_case_skipped(why: impl std::fmt::Display) {
    let case = "cuda";
    if std::env::var_os("STRATA_REQUIRE_CUDA").is_some_and(|v| v == "1") {
        panic!("{case} case could not run, and STRATA_REQUIRE_CUDA=1 requires it: {why}");
    }
    eprintln!("{case} case skipped: {why}");
}
