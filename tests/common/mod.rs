//! Helpers shared by the tests: finite differences, and the small MoE
//! stack, batches and comparisons of the equivalence tests.

// Each test binary uses its own subset.
#![allow(dead_code)]

pub mod hooked;
pub mod process;
pub mod ranks;
pub mod tiny_lm;

use strata::math::ExpertKind;
use strata::model::{fill_uniform, Batch, ModelConfig};
use strata_optim::AdamWHyper;

pub fn values(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect()
}

/// Central differences of `loss` at `x` against `analytic`. The step 1e-6
/// leaves a truncation error of ~1e-12·|f'''| and a rounding error of
/// ~1e-16/1e-6 = 1e-10, so 1e-6 relative (floored at 1e-8) is a safe bound
/// for smooth functions of O(1) inputs.
pub fn check(name: &str, x: &[f64], analytic: &[f64], mut loss: impl FnMut(&[f64]) -> f64) {
    assert_eq!(x.len(), analytic.len());
    let h = 1e-6;
    let mut worst = 0.0f64;
    for i in 0..x.len() {
        let mut xp = x.to_vec();
        xp[i] += h;
        let mut xm = x.to_vec();
        xm[i] -= h;
        let numeric = (loss(&xp) - loss(&xm)) / (2.0 * h);
        let err = (numeric - analytic[i]).abs() / numeric.abs().max(analytic[i].abs()).max(1e-2);
        worst = worst.max(err);
        assert!(
            err < 1e-6,
            "{name}[{i}]: numeric {numeric} analytic {}",
            analytic[i]
        );
    }
    eprintln!(
        "{name}: worst relative error {worst:.2e} over {} inputs",
        x.len()
    );
}

pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

pub fn model(top_k: usize, kind: ExpertKind) -> ModelConfig {
    ModelConfig {
        layers: 2,
        d_model: 16,
        d_ff: 24,
        experts: 8,
        top_k,
        renormalize: top_k > 1,
        expert_kind: kind,
        classes: 10,
        aux_loss_coef: 0.01,
        z_loss_coef: 0.001,
        scoring: strata::math::Scoring::Softmax,
        rms_eps: 1e-5,
        seed: 7,
    }
}

/// A batch per step: inputs uniform(±1), targets a function of the inputs
/// (so the loss can fall).
pub fn batch(model: &ModelConfig, step: usize) -> Batch {
    let t = 48;
    let mut inputs = vec![0.0f32; t * model.d_model];
    fill_uniform(&mut inputs, 1000 + step as u64, 1, 1.0);
    let targets = (0..t)
        .map(|i| {
            let row = &inputs[i * model.d_model..(i + 1) * model.d_model];
            let s: f32 = row.iter().take(4).sum();
            ((s + 4.0) / 8.0 * model.classes as f32).clamp(0.0, model.classes as f32 - 1.0) as u32
        })
        .collect();
    Batch { inputs, targets }
}

/// AdamW set so that an update keeps its gradient's scale. ε = 1 is far
/// above every |g| of these models (≤ 0.05), so m̂ / (√v̂ + ε) ≈ m̂ and a
/// step is momentum SGD of rate lr: a gradient off by a factor moves the
/// params by about that factor, and runs that compare params after
/// training see it. (With the default ε = 1e-8 the update is
/// ≈ lr · sign(g) whatever the gradient's size, so a gradient counted
/// twice, or a sum divided wrongly, would not show.) lr = 0.5 moves a
/// param by 0.5·|g| a step: 1e-4 to 1e-2.
pub fn hyper() -> AdamWHyper {
    AdamWHyper {
        lr: 0.5,
        eps: 1.0,
        ..AdamWHyper::default()
    }
}

/// Bytes of one expert record with f32 compute params: compute params +
/// 12 bytes a param (master, m, v), each part in 4 KiB pages.
pub fn record_bytes(model: &ModelConfig) -> u64 {
    let expert_bytes = (model.expert_params() * 4) as u64;
    (expert_bytes + 64).div_ceil(4096) * 4096 + (3 * expert_bytes + 64).div_ceil(4096) * 4096
}

/// Largest |a − b| / (1 + |b|) over two parameter vectors.
pub fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
        .fold(0.0, f32::max)
}

/// Runs `body` on its own thread and fails the test, naming `what`, if it
/// has not finished within `bound`: a hang becomes a failure instead of a
/// stalled suite. (The stuck thread is left behind; the test binary ends
/// once its other tests have run.) A panic in `body` fails the test too.
pub fn bounded<T: Send + 'static>(
    what: &str,
    bound: std::time::Duration,
    body: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = std::thread::Builder::new()
        .name(format!("bounded: {what}"))
        .spawn(move || {
            let _ = tx.send(body());
        })
        .expect("a test thread starts");
    match rx.recv_timeout(bound) {
        Ok(value) => {
            handle.join().expect("the thread sent its result");
            value
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            // The thread ended without a result: it panicked.
            std::panic::resume_unwind(handle.join().expect_err("no result, so it panicked"))
        }
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what} did not finish within {bound:?} (the watchdog's bound): it hangs")
        }
    }
}

/// Says why a case that needs CUDA (a GPU, or the CPU model of one, with
/// NVRTC and ptxas) could not run. Where CUDA is expected, as in CI's
/// driver-model block, `STRATA_REQUIRE_CUDA=1` makes that a failure
/// instead of a skip that `cargo test` would show as a pass.
pub fn case_skipped(case: &str, why: impl std::fmt::Display) {
    if std::env::var_os("STRATA_REQUIRE_CUDA").is_some_and(|v| v == "1") {
        panic!("{case} case could not run, and STRATA_REQUIRE_CUDA=1 requires it: {why}");
    }
    eprintln!("{case} case skipped: {why}");
}

/// [`case_skipped`] for a case that needs a CUDA device.
pub fn cuda_case_skipped(why: impl std::fmt::Display) {
    case_skipped("cuda", why)
}

/// Flips one bit of the byte at `at` in `path`.
pub fn flip_byte(path: &std::path::Path, at: u64) {
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut byte = [0u8];
    f.seek(SeekFrom::Start(at)).unwrap();
    f.read_exact(&mut byte).unwrap();
    byte[0] ^= 0x40;
    f.seek(SeekFrom::Start(at)).unwrap();
    f.write_all(&byte).unwrap();
}

/// Flips a byte of `slot`'s compute params in both copies of its record
/// in the store file `store`, so whichever copy is committed is damaged.
pub fn damage_record(store: &std::path::Path, slot: u64) {
    use strata_tiers::format::PART_HEADER_BYTES;
    let layout =
        strata_tiers::ExpertStore::open(store, None, &strata_tiers::io::FileOptions::default())
            .unwrap()
            .layout();
    for copy in 0..2 {
        flip_byte(
            store,
            layout.record_offset(slot, copy) + PART_HEADER_BYTES as u64 + 5,
        );
    }
}
