//! The cpu device: expert slots in host memory ([`CpuDeviceArena`]),
//! each expert computed by the cpu backend's FFN from the slot's bf16
//! params as they are stored ([`ExpertGemm::Bf16`]) or widened into a
//! reused f32 buffer, with reused hidden-size buffers. A group of experts
//! ([`ExpertDevice::experts_forward`], `experts_backward`) is computed
//! side by side, an expert to a compute thread with that thread's buffers
//! and its GEMMs on that thread alone: one split for the group rather than
//! several for each expert's GEMMs, and the same bits (no expert's sums
//! depend on its threads).

use std::sync::{Arc, Mutex};

use strata_tiers::{CpuDeviceArena, DeviceArena, Dtype, Layout};

use super::activations::for_parts;
use super::cpu::{ffn_backward, ffn_forward, FfnScratch};
use super::cpu_bf16::{ffn_backward_bf16, ffn_forward_bf16};
use super::expert_device::{ExpertBackward, ExpertDevice, ExpertForward, SlotParams};
use super::gemm::Write;
use super::{CpuBackend, ExpertGemm};
use crate::math::{ExpertKind, ExpertSaved};
use crate::model::DenseKernels;
use crate::parallel::{compute_threads, on_one_thread, run_all};
use crate::EngineError;

/// The cpu device: slots in host memory ([`CpuDeviceArena`]), experts
/// computed by [`CpuBackend`] from bf16 params as they are stored
/// ([`ExpertGemm::Bf16`]) or on the slot's params widened to f32.
pub struct CpuExpertDevice {
    arena: CpuDeviceArena,
    gemm: ExpertGemm,
    /// The buffers of the experts computing at once: one a thread of a
    /// group side by side, the first also an expert's computed alone
    /// (reused).
    buffers: Vec<ExpertBuffers>,
}

/// What the cpu device computes an expert with, reused.
#[derive(Default)]
struct ExpertBuffers {
    /// The expert's params widened, where it computes in f32.
    params: Vec<f32>,
    /// The FFN's hidden-size buffers.
    scratch: FfnScratch,
}

/// An expert's params as the cpu device computes from them.
enum ExpertParams<'a> {
    /// bf16 bits, as the slot stores them.
    Bf16(&'a [u16]),
    /// Widened.
    F32(&'a [f32]),
}

/// The most experts the cpu device computes side by side in one call.
pub const CPU_GROUP_MAX: usize = 64;

/// The experts a cpu device stages and computes at once at most:
/// [`CPU_GROUP_MAX`], a layer's experts for most models (the fewer and
/// larger the groups, the fewer the waits for a group's slowest expert);
/// 1 on one compute thread, where a group would gain nothing.
pub fn cpu_group_limit() -> usize {
    match compute_threads() {
        1 => 1,
        _ => CPU_GROUP_MAX,
    }
}

/// Copies in flight the cpu device's copy queues hold.
const CPU_COPIES_MAX: usize = 64;

impl CpuExpertDevice {
    /// Carves `device_budget_bytes` into slots of one expert's compute
    /// params each.
    pub fn new(
        device_budget_bytes: u64,
        layout: &Layout,
        gemm: ExpertGemm,
    ) -> Result<Self, EngineError> {
        let slot_bytes = layout.compute_payload_bytes() as usize;
        Ok(Self {
            arena: CpuDeviceArena::new(device_budget_bytes, slot_bytes, CPU_COPIES_MAX)?,
            gemm,
            buffers: vec![ExpertBuffers::default()],
        })
    }

    /// Runs `body` on the slot's params with `buffers`' scratch: bf16 as
    /// they are stored where they are bf16 and the device computes in
    /// bf16, else widened into `buffers`' params ([`widen`]).
    fn compute<T>(
        arena: &CpuDeviceArena,
        gemm: ExpertGemm,
        buffers: &mut ExpertBuffers,
        p: SlotParams,
        body: impl FnOnce(ExpertParams, &mut FfnScratch) -> T,
    ) -> Result<T, EngineError> {
        if p.dtype == Dtype::Bf16 && gemm == ExpertGemm::Bf16 {
            let view = arena.view(p.slot)?;
            let bytes = &view.bytes()[..p.count * 2];
            let params: &[u16] = bytemuck::try_cast_slice(bytes).map_err(|e| {
                EngineError::Config(format!("a slot's bf16 params are not 2-byte aligned: {e}"))
            })?;
            return Ok(body(ExpertParams::Bf16(params), &mut buffers.scratch));
        }
        widen(arena, p, &mut buffers.params)?;
        Ok(body(
            ExpertParams::F32(&buffers.params),
            &mut buffers.scratch,
        ))
    }

    /// Runs `one` on each expert of `group`, side by side on the compute
    /// threads, each on its thread alone ([`on_one_thread`]) with buffers
    /// no other expert computing meanwhile holds (taken from the device's
    /// and given back, so there are never more than threads computing at
    /// once); the first error, if any.
    fn side_by_side<E: Send>(
        &mut self,
        group: &mut [E],
        rows: impl Fn(&E) -> usize,
        one: impl Fn(&CpuDeviceArena, ExpertGemm, &mut ExpertBuffers, &mut E) -> Result<(), EngineError>
            + Sync,
    ) -> Result<(), EngineError> {
        let (arena, gemm, one) = (&self.arena, self.gemm, &one);
        let pool = Mutex::new(std::mem::take(&mut self.buffers));
        let free = &pool;
        let mut results: Vec<Result<(), EngineError>> = group.iter().map(|_| Ok(())).collect();
        let mut jobs: Vec<_> = group
            .iter_mut()
            .zip(&mut results)
            .map(|(e, result)| {
                let rows = rows(e);
                let job = move || {
                    let lock = || free.lock().unwrap_or_else(|e| e.into_inner());
                    let mut buffers = lock().pop().unwrap_or_default();
                    *result = on_one_thread(|| one(arena, gemm, &mut buffers, e));
                    lock().push(buffers);
                };
                (rows, job)
            })
            .collect();
        // The most rows first: the threads take the queued experts in
        // turn, so the last to start are the shortest.
        jobs.sort_by_key(|&(rows, _)| std::cmp::Reverse(rows));
        run_all(jobs.into_iter().map(|(_, job)| job).collect());
        self.buffers = pool.into_inner().unwrap_or_else(|e| e.into_inner());
        if self.buffers.is_empty() {
            self.buffers.push(ExpertBuffers::default());
        }
        results.into_iter().collect()
    }
}

/// Whether the cpu device computes a group of `experts` side by side:
/// where it has at least two experts a thread, so that the threads, taking
/// the most rows first, end close together. A smaller group is computed an
/// expert at a time, each GEMM split over the threads (on small's shapes
/// on two threads, groups of 2 ran at 0.85 of that, whole layers of 8 at
/// 1.05: docs/performance.md).
pub fn cpu_group_side_by_side(experts: usize) -> bool {
    let threads = compute_threads();
    threads > 1 && experts >= 2 * threads
}

/// Widens the slot's params into `params`, split over the cores as the
/// cpu backend's activation passes are (each element alone, so the cut
/// changes no bit).
fn widen(arena: &CpuDeviceArena, p: SlotParams, params: &mut Vec<f32>) -> Result<(), EngineError> {
    let view = arena.view(p.slot)?;
    let width = p.dtype.bytes() as usize;
    let bytes = &view.bytes()[..p.count * width];
    params.resize(p.count, 0.0);
    for_parts(params, |at, out| {
        widen_into(out, &bytes[at * width..(at + out.len()) * width], p.dtype)
    });
    Ok(())
}

/// One expert's forward, as [`ExpertDevice::expert_forward`].
#[allow(clippy::too_many_arguments)]
fn forward_one(
    arena: &CpuDeviceArena,
    gemm: ExpertGemm,
    buffers: &mut ExpertBuffers,
    kind: ExpertKind,
    e: &mut ExpertForward,
    (d, f): (usize, usize),
) -> Result<(), EngineError> {
    let n = e.x.len() / d;
    let (out, saved, x) = (&mut *e.out, &mut *e.saved, e.x);
    CpuExpertDevice::compute(arena, gemm, buffers, e.params, |p, scratch| match p {
        ExpertParams::Bf16(p) => ffn_forward_bf16(kind, out, saved, x, p, n, d, f, scratch),
        ExpertParams::F32(p) => ffn_forward(kind, out, saved, x, p, n, d, f, scratch),
    })
}

/// One expert's backward, as [`ExpertDevice::expert_backward`].
fn backward_one(
    arena: &CpuDeviceArena,
    gemm: ExpertGemm,
    buffers: &mut ExpertBuffers,
    kind: ExpertKind,
    e: &mut ExpertBackward,
    (d, f): (usize, usize),
) -> Result<(), EngineError> {
    let n = e.x.len() / d;
    let set = Write::Set;
    let (dx, dp, dout, saved, x) = (&mut *e.dx, &mut *e.dparams, e.dout, e.saved, e.x);
    CpuExpertDevice::compute(arena, gemm, buffers, e.params, |p, s| match p {
        ExpertParams::Bf16(p) => {
            ffn_backward_bf16(kind, dx, dp, set, dout, saved, x, p, n, d, f, s)
        }
        ExpertParams::F32(p) => ffn_backward(kind, dx, dp, set, dout, saved, x, p, n, d, f, s),
    })
}

/// out = `bytes` read as `dtype`, widened to f32.
fn widen_into(out: &mut [f32], bytes: &[u8], dtype: Dtype) {
    match dtype {
        Dtype::F32 => out.copy_from_slice(bytemuck::cast_slice::<u8, f32>(bytes)),
        Dtype::Bf16 => {
            let src = bytemuck::cast_slice::<u8, half::bf16>(bytes);
            out.iter_mut().zip(src).for_each(|(o, x)| *o = x.to_f32());
        }
        Dtype::F16 => {
            let src = bytemuck::cast_slice::<u8, half::f16>(bytes);
            out.iter_mut().zip(src).for_each(|(o, x)| *o = x.to_f32());
        }
    }
}

impl ExpertDevice for CpuExpertDevice {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn arena(&self) -> &dyn DeviceArena {
        &self.arena
    }

    fn dense_kernels(&self) -> Arc<dyn DenseKernels + Send + Sync> {
        Arc::new(CpuBackend)
    }

    fn expert_forward(
        &mut self,
        kind: ExpertKind,
        out: &mut [f32],
        saved: &mut ExpertSaved<f32>,
        x: &[f32],
        params: SlotParams,
        _n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        let mut e = ExpertForward {
            params,
            x,
            out,
            saved,
        };
        let buffers = &mut self.buffers[0];
        forward_one(&self.arena, self.gemm, buffers, kind, &mut e, (d, f))
    }

    fn expert_backward(
        &mut self,
        kind: ExpertKind,
        dx: &mut [f32],
        dparams: &mut [f32],
        dout: &[f32],
        saved: &ExpertSaved<f32>,
        x: &[f32],
        params: SlotParams,
        _n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        let mut e = ExpertBackward {
            params,
            x,
            dout,
            saved,
            dx,
            dparams,
        };
        let buffers = &mut self.buffers[0];
        backward_one(&self.arena, self.gemm, buffers, kind, &mut e, (d, f))
    }

    fn experts_forward(
        &mut self,
        kind: ExpertKind,
        group: &mut [ExpertForward],
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        if !cpu_group_side_by_side(group.len()) {
            let (arena, gemm, buffers) = (&self.arena, self.gemm, &mut self.buffers[0]);
            return group
                .iter_mut()
                .try_for_each(|e| forward_one(arena, gemm, buffers, kind, e, (d, f)));
        }
        let rows = |e: &ExpertForward| e.x.len() / d;
        self.side_by_side(group, rows, |arena, gemm, buffers, e| {
            forward_one(arena, gemm, buffers, kind, e, (d, f))
        })
    }

    fn experts_backward(
        &mut self,
        kind: ExpertKind,
        group: &mut [ExpertBackward],
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        if !cpu_group_side_by_side(group.len()) {
            let (arena, gemm, buffers) = (&self.arena, self.gemm, &mut self.buffers[0]);
            return group
                .iter_mut()
                .try_for_each(|e| backward_one(arena, gemm, buffers, kind, e, (d, f)));
        }
        let rows = |e: &ExpertBackward| e.x.len() / d;
        self.side_by_side(group, rows, |arena, gemm, buffers, e| {
            backward_one(arena, gemm, buffers, kind, e, (d, f))
        })
    }

    fn group_limit(&self) -> usize {
        cpu_group_limit()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Experts of a few shapes' rows (one empty), their params bf16 in
    /// slots: computed side by side, forward and backward, they give the
    /// bits of each computed alone, in both compute dtypes of the slot.
    #[test]
    fn a_group_side_by_side_gives_each_expert_s_bits_alone() {
        let (d, f, kind) = (24, 40, ExpertKind::SwiGlu);
        let layout = Layout {
            layers: 1,
            experts_per_layer: 5,
            params_per_expert: kind.params(d, f) as u64,
            compute_dtype: Dtype::Bf16,
            moments: true,
        };
        let rows = [37usize, 5, 0, 64, 19];
        let value = |i: usize, seed: usize| ((i * 7919 + seed * 104_729) % 2001) as f32 / 1e4 - 0.1;
        for gemm in [ExpertGemm::Bf16, ExpertGemm::F32] {
            let budget = rows.len() as u64 * layout.compute_payload_bytes();
            let mut device = CpuExpertDevice::new(budget, &layout, gemm).unwrap();
            let params: Vec<SlotParams> = (0..rows.len())
                .map(|slot| {
                    let bits: Vec<u8> = (0..kind.params(d, f))
                        .flat_map(|i| half::bf16::from_f32(value(i, slot)).to_le_bytes())
                        .collect();
                    device
                        .arena
                        .upload_htod(slot, Box::new(bits))
                        .unwrap()
                        .wait()
                        .unwrap();
                    SlotParams::new(&layout, slot)
                })
                .collect();
            let xs: Vec<Vec<f32>> = rows
                .iter()
                .enumerate()
                .map(|(e, &n)| (0..n * d).map(|i| value(i, 10 + e)).collect())
                .collect();
            let douts: Vec<Vec<f32>> = rows
                .iter()
                .enumerate()
                .map(|(e, &n)| (0..n * d).map(|i| value(i, 20 + e)).collect())
                .collect();
            // Each alone.
            let mut alone = Vec::new();
            for (e, &n) in rows.iter().enumerate() {
                let (mut out, mut saved) = (vec![0.0; n * d], ExpertSaved::default());
                device
                    .expert_forward(kind, &mut out, &mut saved, &xs[e], params[e], n, d, f)
                    .unwrap();
                let (mut dx, mut dp) = (vec![0.0; n * d], vec![0.0; kind.params(d, f)]);
                let (x, dout) = (&xs[e], &douts[e]);
                device
                    .expert_backward(kind, &mut dx, &mut dp, dout, &saved, x, params[e], n, d, f)
                    .unwrap();
                alone.push((out, dx, dp));
            }
            // Side by side, whatever the threads.
            let mut outs: Vec<Vec<f32>> = rows.iter().map(|&n| vec![f32::NAN; n * d]).collect();
            let mut saved: Vec<ExpertSaved<f32>> =
                rows.iter().map(|_| ExpertSaved::default()).collect();
            let mut group: Vec<ExpertForward> = outs
                .iter_mut()
                .zip(&mut saved)
                .enumerate()
                .map(|(e, (out, saved))| ExpertForward {
                    params: params[e],
                    x: &xs[e],
                    out,
                    saved,
                })
                .collect();
            let forward = |e: &ExpertForward| e.x.len() / d;
            device
                .side_by_side(&mut group, forward, |arena, gemm, buffers, e| {
                    forward_one(arena, gemm, buffers, kind, e, (d, f))
                })
                .unwrap();
            drop(group);
            let mut dxs: Vec<Vec<f32>> = rows.iter().map(|&n| vec![f32::NAN; n * d]).collect();
            let mut dps: Vec<Vec<f32>> = rows
                .iter()
                .map(|_| vec![f32::NAN; kind.params(d, f)])
                .collect();
            let mut group: Vec<ExpertBackward> = dxs
                .iter_mut()
                .zip(&mut dps)
                .enumerate()
                .map(|(e, (dx, dparams))| ExpertBackward {
                    params: params[e],
                    x: &xs[e],
                    dout: &douts[e],
                    saved: &saved[e],
                    dx,
                    dparams,
                })
                .collect();
            let backward = |e: &ExpertBackward| e.x.len() / d;
            device
                .side_by_side(&mut group, backward, |arena, gemm, buffers, e| {
                    backward_one(arena, gemm, buffers, kind, e, (d, f))
                })
                .unwrap();
            drop(group);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for (e, (out, dx, dp)) in alone.iter().enumerate() {
                assert_eq!(bits(out), bits(&outs[e]), "{gemm:?}: expert {e}'s output");
                assert_eq!(
                    bits(dx),
                    bits(&dxs[e]),
                    "{gemm:?}: expert {e}'s input gradient"
                );
                assert_eq!(bits(dp), bits(&dps[e]), "{gemm:?}: expert {e}'s gradient");
            }
            assert!(alone
                .iter()
                .any(|(out, _, _)| out.iter().any(|&v| v != 0.0)));
        }
    }

    /// An error computing one expert of a group (a slot that does not
    /// exist) reaches the caller.
    #[test]
    fn an_expert_s_error_in_a_group_is_returned() {
        let (d, f, kind) = (8, 16, ExpertKind::SwiGlu);
        let layout = Layout {
            layers: 1,
            experts_per_layer: 2,
            params_per_expert: kind.params(d, f) as u64,
            compute_dtype: Dtype::Bf16,
            moments: true,
        };
        let mut device = CpuExpertDevice::new(
            2 * layout.compute_payload_bytes(),
            &layout,
            ExpertGemm::Bf16,
        )
        .unwrap();
        let x = vec![0.5f32; 3 * d];
        let (mut out0, mut out1) = (vec![0.0; 3 * d], vec![0.0; 3 * d]);
        let (mut s0, mut s1) = (ExpertSaved::default(), ExpertSaved::default());
        let mut group = vec![
            ExpertForward {
                params: SlotParams::new(&layout, 0),
                x: &x,
                out: &mut out0,
                saved: &mut s0,
            },
            ExpertForward {
                params: SlotParams::new(&layout, 7),
                x: &x,
                out: &mut out1,
                saved: &mut s1,
            },
        ];
        let err = device
            .side_by_side(
                &mut group,
                |e| e.x.len() / d,
                |arena, gemm, buffers, e| forward_one(arena, gemm, buffers, kind, e, (d, f)),
            )
            .unwrap_err();
        assert!(err.to_string().contains("slot 7"), "{err}");
    }
}
