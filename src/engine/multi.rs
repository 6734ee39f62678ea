//! Several devices (ES-MoE §4.2–4.3): each device worker runs on its own
//! thread with its own device tier and takes an equal, contiguous share of
//! the batch's micro-batches; dense params are shared read-only and their
//! gradients all-reduced in rank order before the one AdamW update (in
//! buckets, as the backward finishes each, beside the rest of the
//! backward: `dense_buckets.rs`); the
//! experts of each layer are placed by greedy LPT over the global token
//! counts and the tokens exchanged (`exchange.rs`); each device pins the
//! hottest experts of the previous step.
//!
//! Losses: each device's micro-batch is one micro-batch of the step, so N
//! devices × m micro-batches train exactly the model one device trains
//! with N·m micro-batches (the load-balancing and z losses are per
//! micro-batch, as in gradient accumulation). The two differ only in the
//! order of float sums (see `tests/multi_device.rs`).

use std::time::Instant;

use strata_tiers::{ExpertId, Layout};

use super::condensing::{condensed_pass, StepCondense};
use super::dense_buckets::{DenseBuckets, ReducerThread};
use super::exchange::{local_cost, ExchangeRunner};
use super::pipeline::DeviceRunner;
use super::step::step_condense;
use super::{Engine, StepMetrics};
use crate::comm::{Comm, InProcessComm, ModeledLink};
use crate::model::{DenseKernels, ModelConfig, Network};
use crate::placement::CostModel;
use crate::EngineError;

/// Expert GEMM throughput assumed until the first step is measured.
const PRIOR_FLOPS_PER_S: f64 = 50e9;

/// The placement cost model before any step: the upload time of one
/// expert measured now (a copy of its compute params, twice per step:
/// forward and backward), and a FLOP-count prior for compute that the
/// first step replaces by its measurement.
pub(crate) fn initial_cost(model: &ModelConfig, layout: &Layout, devices: usize) -> CostModel {
    let per_token_s = 6.0 * model.expert_params() as f64 / PRIOR_FLOPS_PER_S;
    if devices == 1 {
        return CostModel {
            upload_s: 0.0,
            per_token_s,
            fixed_s: 0.0,
        };
    }
    let bytes = layout.compute_payload_bytes() as usize;
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut times: Vec<f64> = (0..5)
        .map(|_| {
            let t0 = Instant::now();
            dst.copy_from_slice(std::hint::black_box(&src));
            std::hint::black_box(&mut dst);
            t0.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    CostModel {
        upload_s: 2.0 * times[2],
        per_token_s,
        fixed_s: 0.0,
    }
}

impl Engine {
    /// Every device's micro-batches, each on its device's thread (kept for
    /// the run: `device_threads`); returns the
    /// loss and the all-reduced dense gradient.
    pub(super) fn passes_devices<N>(
        &mut self,
        net: &N,
        batch: &N::Batch,
        tokens_total: usize,
    ) -> Result<(f32, Vec<f32>), EngineError>
    where
        N: Network + Sync,
        N::Batch: Sync,
    {
        let n = self.devices.len();
        let m = self.config.micro_batches;
        let parts = split_into(net, batch, n, m, "devices")?;
        let pinned = self.pin_plan();
        let options = self.pass_options();
        let cost = self.cost;
        let link = self.config.link;
        let bucket_bytes = self.config.dense_bucket_bytes;
        let tuning = self.exchange_tuning();
        let condense = step_condense(&self.config, self.signatures.as_ref(), self.condense_losses);
        for i in self.dense_reducers.len()..n {
            let name = format!("strata-dense-reduce-{i}");
            self.dense_reducers.push(ReducerThread::new(name));
        }
        let Engine {
            model,
            shared,
            devices,
            dense_kernels,
            dense,
            device_threads,
            dense_reducers,
            ..
        } = self;
        let (model, shared, dense) = (&*model, &*shared, &dense[..]);
        let pinned = &pinned[..];
        let parts = &parts[..];
        let tuning = &tuning;
        // Devices as many as the compute threads or more already keep
        // every thread busy: each computes on its own thread alone, as a
        // split of its GEMMs would only queue pieces for threads busy
        // with the other devices' (small, two devices on two compute
        // threads: 1.2x the tokens/s of splitting).
        let one_thread_each = n >= crate::parallel::compute_threads();
        let dense_reducers = &dense_reducers[..];
        let shares: Vec<_> = devices
            .iter_mut()
            .zip(dense_kernels.iter())
            .zip(
                InProcessComm::endpoints(n)
                    .into_iter()
                    .map(|c| ModeledLink::new(c, link))
                    .zip(InProcessComm::endpoints(n)),
            )
            .enumerate()
            .map(|(rank, ((dev, kernels), (comm, second)))| {
                move || {
                    let share = || {
                        let inner = DeviceRunner::new(model, shared, dev, options);
                        let mut runner = ExchangeRunner::new(inner, comm, cost, pinned, None)
                            .tuned(tuning.clone());
                        let share = Share {
                            net,
                            parts: &parts[rank * m..(rank + 1) * m],
                            dense,
                            tokens_total,
                            shares: n * m,
                            bucket_bytes,
                            reducer: &dense_reducers[rank],
                            condense,
                        };
                        let mut second = Some(Box::new(second) as Box<dyn Comm>);
                        device_share(&mut runner, &**kernels, share, &mut second)
                    };
                    match one_thread_each {
                        true => crate::parallel::on_one_thread(share),
                        false => share(),
                    }
                }
            })
            .collect();
        let results: Vec<Result<(f32, Vec<f32>), EngineError>> = device_threads
            .run(shares)
            .into_iter()
            .enumerate()
            .map(|(device, result)| result.unwrap_or_else(|failed| Err(failed.of_device(device))))
            .collect();
        first_cause(results)
    }

    /// Which experts each device pins this step: per layer, the
    /// `pin_fraction` most loaded of the previous step, hottest first,
    /// dealt to the devices in turn (the turn carries across layers), or
    /// on ranks as processes each to the rank that owns it; at most
    /// `slots − 2` per device.
    pub(super) fn pin_plan(&mut self) -> Vec<Vec<Option<u16>>> {
        let (layers, experts) = (self.model.layers, self.model.experts);
        let n = self.config.workers();
        // The world's index of this process's first device.
        let first = self.ranks.as_ref().map_or(0, |r| r.comm.rank());
        let owners = self.ranks.as_ref().map(|r| &r.owners);
        let mut plan = vec![vec![None; experts]; layers];
        let per_layer = (self.config.pin_fraction * experts as f64).ceil() as usize;
        let cap = self.device_slots().saturating_sub(2);
        if let (Some(load), true) = (&self.prev_load, per_layer > 0 && cap > 0) {
            let mut count = vec![0usize; n];
            let mut turn = 0usize;
            for l in 0..layers {
                let mut ranked: Vec<usize> = (0..experts).filter(|&e| load[l][e] > 0).collect();
                ranked.sort_by_key(|&e| (std::cmp::Reverse(load[l][e]), e));
                for &e in ranked.iter().take(per_layer) {
                    let d = owners.map_or(turn % n, |o| o[l][e] as usize);
                    turn += 1;
                    if count[d] < cap {
                        plan[l][e] = Some(d as u16);
                        count[d] += 1;
                    }
                }
            }
        }
        for (local, dev) in self.devices.iter_mut().enumerate() {
            let d = first + local;
            let plan = &plan;
            dev.slots
                .set_pinned((0..layers * experts).filter(move |&k| {
                    let id = ExpertId::from_dense_index(k, experts);
                    plan[id.layer as usize][id.index as usize] == Some(d as u16)
                }));
        }
        plan
    }

    /// The placement's compute cost per token, and the slowest device's
    /// own work in the exchange per expert (the layer's exchange ends with
    /// it), from the step just measured.
    pub(super) fn recalibrate(&mut self, m: &StepMetrics) {
        let secs: f64 = m.expert_compute_s_per_device.iter().sum();
        let passes: u64 = m.assignments_per_device.iter().sum();
        if secs > 0.0 && passes > 0 {
            // Each assignment is computed twice (forward, backward).
            self.cost.per_token_s = 2.0 * secs / passes as f64;
        }
        let slowest = m
            .exchange_local_s_per_device
            .iter()
            .zip(&m.exchange_experts_per_device)
            .map(|(local, experts)| local_cost(*local, *experts))
            .fold([0.0f64; 2], |s, d| [s[0].max(d[0]), s[1].max(d[1])]);
        if passes > 0 {
            self.exchange_local = slowest;
        }
    }

    /// Experts pinned on each device for the last step.
    pub fn pinned_per_device(&self) -> Vec<usize> {
        self.devices
            .iter()
            .map(|d| d.slots.pinned_count())
            .collect()
    }
}

/// `batch` cut into `workers` × `m` micro-batches, or the error that says
/// how many sequences that needs (`what`: devices or ranks).
pub(super) fn split_into<N: Network>(
    net: &N,
    batch: &N::Batch,
    workers: usize,
    m: usize,
    what: &str,
) -> Result<Vec<N::Batch>, EngineError> {
    let parts = net.split_batch(batch, workers * m);
    if parts.len() != workers * m {
        return Err(EngineError::Batch(format!(
            "the batch splits into {} parts, but {workers} {what} × {m} micro-batches need {}: \
             give the step at least {} sequences (or rows), or use fewer {what}",
            parts.len(),
            workers * m,
            workers * m
        )));
    }
    Ok(parts)
}

/// One device's share of a step, besides its runner.
pub(super) struct Share<'a, N: Network> {
    pub net: &'a N,
    /// This device's micro-batches.
    pub parts: &'a [N::Batch],
    pub dense: &'a [f32],
    pub tokens_total: usize,
    /// Micro-batches in the whole step, over every device.
    pub shares: usize,
    /// `EngineConfig::dense_bucket_bytes`.
    pub bucket_bytes: usize,
    /// The thread this device's buckets are reduced on.
    pub reducer: &'a ReducerThread,
    pub condense: Option<StepCondense<'a>>,
}

/// One device's micro-batches through its exchange; returns the step's
/// loss and dense gradient, both all-reduced over the devices (rank order).
/// With a `second` endpoint, and a dense gradient summed on the host, the
/// gradient is reduced in buckets beside the backward, over `second`,
/// which is put back for the next step once the step has succeeded.
pub(super) fn device_share<N: Network, C: Comm>(
    runner: &mut ExchangeRunner<'_, ModeledLink<C>>,
    kernels: &dyn DenseKernels,
    share: Share<'_, N>,
    second: &mut Option<Box<dyn Comm>>,
) -> Result<(f32, Vec<f32>), EngineError> {
    let mut grad = vec![0.0f32; share.dense.len()];
    kernels.grads_begin(&grad);
    runner.buckets = match second.take() {
        Some(endpoint) if !kernels.grads_on_device() && runner.comm.size() > 1 => {
            Some(DenseBuckets::start(
                share.reducer,
                endpoint,
                &runner.comm,
                grad.len(),
                share.bucket_bytes,
            )?)
        }
        kept => {
            *second = kept;
            None
        }
    };
    let passed = micro_batches(runner, kernels, &share, &mut grad);
    // A failed step drops its buckets here: its reducer stops.
    let buckets = runner.buckets.take();
    let loss = passed?;
    kernels.grads_flush(&mut grad)?;
    let mut waited = std::time::Duration::ZERO;
    match buckets {
        Some(buckets) => {
            let (endpoint, wait) = buckets.finish(&mut grad)?;
            *second = Some(endpoint);
            waited = wait;
        }
        None => runner.comm.all_reduce_sum(&mut grad)?,
    }
    let mut total = [loss];
    runner.comm.all_reduce_sum(&mut total)?;
    runner.inner.dev.acc.comm_s = (runner.comm.comm_time + waited).as_secs_f64();
    Ok((total[0], grad))
}

/// This device's micro-batches, forward and backward, the dense gradient
/// summed into `grad`; returns their loss.
fn micro_batches<N: Network, C: Comm>(
    runner: &mut ExchangeRunner<'_, ModeledLink<C>>,
    kernels: &dyn DenseKernels,
    share: &Share<'_, N>,
    grad: &mut [f32],
) -> Result<f32, EngineError> {
    let model = runner.inner.model;
    let mut loss = 0.0f32;
    let m = share.parts.len();
    for (j, part) in share.parts.iter().enumerate() {
        let (losses, condensed) = condensed_pass(runner, share.condense, model, |experts| {
            share.net.forward_backward(
                share.dense,
                grad,
                part,
                share.tokens_total,
                share.shares,
                j + 1 == m,
                experts,
                kernels,
            )
        })?;
        loss += losses.total;
        runner.inner.dev.acc.condensed += condensed;
    }
    Ok(loss)
}

/// The error to report from the devices' results: the first that is not
/// a peer stopping because of another's failure, else the first.
fn first_cause(
    results: Vec<Result<(f32, Vec<f32>), EngineError>>,
) -> Result<(f32, Vec<f32>), EngineError> {
    let mut first_err = None;
    let mut first_ok = None;
    for r in results {
        match r {
            Ok(v) => {
                first_ok.get_or_insert(v);
            }
            Err(EngineError::Comm(c)) => {
                first_err.get_or_insert(EngineError::Comm(c));
            }
            Err(e) => return Err(e),
        }
    }
    match (first_err, first_ok) {
        (Some(e), _) => Err(e),
        (None, Some(v)) => Ok(v),
        (None, None) => Err(EngineError::Config("no device ran".into())),
    }
}
