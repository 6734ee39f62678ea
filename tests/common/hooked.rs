//! A network that is another in everything but its forward-backward, which
//! goes through a test's hook: a failure on one device, a runner of the
//! test's own around the engine's. `armed` is the hook's switch.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::Duration;

use strata::engine::{Engine, EngineConfig};
use strata::lm::TokenBatch;
use strata::model::{DenseKernels, Evaluation, ExpertRunner, Losses, ModelConfig, Network};
use strata::EngineError;

use super::tiny_lm::tiny_batch;

/// One micro-batch's forward-backward as the engine asked for it, but
/// for its runner, which the hook is given beside it.
pub struct Pass<'a, B> {
    pub dense: &'a [f32],
    pub dense_grad: &'a mut [f32],
    pub batch: &'a B,
    pub tokens_total: usize,
    pub micro_batches: usize,
    pub last_micro_batch: bool,
    pub kernels: &'a dyn DenseKernels,
}

impl<B> Pass<'_, B> {
    /// The pass through `net`, its experts through `runner` (the
    /// engine's, or one around it).
    pub fn run<N: Network<Batch = B>>(
        self,
        net: &N,
        runner: &mut dyn ExpertRunner,
    ) -> Result<Losses, EngineError> {
        net.forward_backward(
            self.dense,
            self.dense_grad,
            self.batch,
            self.tokens_total,
            self.micro_batches,
            self.last_micro_batch,
            runner,
            self.kernels,
        )
    }
}

/// `inner`, with its forward-backward passed to `hook`.
pub struct Hooked<N, F> {
    pub inner: N,
    pub armed: AtomicBool,
    pub hook: F,
}

impl<N, F> Hooked<N, F> {
    /// Unarmed.
    pub fn new(inner: N, hook: F) -> Self {
        Self {
            inner,
            armed: AtomicBool::new(false),
            hook,
        }
    }
}

/// Whether this thread is device 1's worker of several in one process.
pub fn on_device_1() -> bool {
    std::thread::current().name() == Some("strata-device-1")
}

impl<N, F> Network for Hooked<N, F>
where
    N: Network,
    F: Fn(
        &N,
        &AtomicBool,
        Pass<'_, N::Batch>,
        &mut dyn ExpertRunner,
    ) -> Result<Losses, EngineError>,
{
    type Batch = N::Batch;

    fn moe(&self) -> &ModelConfig {
        self.inner.moe()
    }
    fn dense_params(&self) -> usize {
        self.inner.dense_params()
    }
    fn init_dense(&self) -> Vec<f32> {
        self.inner.init_dense()
    }
    fn validate_batch(&self, batch: &N::Batch) -> Result<(), EngineError> {
        self.inner.validate_batch(batch)
    }
    fn batch_tokens(&self, batch: &N::Batch) -> usize {
        self.inner.batch_tokens(batch)
    }
    fn processed_tokens(&self, batch: &N::Batch) -> usize {
        self.inner.processed_tokens(batch)
    }
    fn split_batch(&self, batch: &N::Batch, n: usize) -> Vec<N::Batch> {
        self.inner.split_batch(batch, n)
    }
    fn frozen_dense(&self) -> Vec<std::ops::Range<usize>> {
        self.inner.frozen_dense()
    }
    fn forward_backward(
        &self,
        dense: &[f32],
        dense_grad: &mut [f32],
        batch: &N::Batch,
        tokens_total: usize,
        micro_batches: usize,
        last_micro_batch: bool,
        runner: &mut dyn ExpertRunner,
        kernels: &dyn DenseKernels,
    ) -> Result<Losses, EngineError> {
        let pass = Pass {
            dense,
            dense_grad,
            batch,
            tokens_total,
            micro_batches,
            last_micro_batch,
            kernels,
        };
        (self.hook)(&self.inner, &self.armed, pass, runner)
    }
    fn forward_eval(
        &self,
        dense: &[f32],
        batch: &N::Batch,
        runner: &mut dyn ExpertRunner,
        kernels: &dyn DenseKernels,
    ) -> Result<Evaluation, EngineError> {
        self.inner.forward_eval(dense, batch, runner, kernels)
    }
}

/// Steps 0, then 1 armed (it must fail), then 1 again and 2, of
/// `tiny_batch` on an engine of `config` over the network `net` makes, on
/// a thread of its own that is never joined: a step left waiting for a
/// peer fails this function's 60 s watchdogs instead of hanging the test
/// run. Returns the failed step's error, the losses of the steps that
/// passed, and what `end` takes from the engine after them.
pub fn around_a_failed_step<N, F, T>(
    net: impl FnOnce() -> Hooked<N, F> + Send + 'static,
    config: EngineConfig,
    end: impl FnOnce(&mut Engine, &N) -> T + Send + 'static,
) -> (String, Vec<f32>, T)
where
    N: Network<Batch = TokenBatch> + Sync,
    F: Fn(
            &N,
            &AtomicBool,
            Pass<'_, TokenBatch>,
            &mut dyn ExpertRunner,
        ) -> Result<Losses, EngineError>
        + Sync,
    T: Send + 'static,
{
    let (said, failed) = mpsc::channel();
    let (ended, run) = mpsc::channel();
    std::thread::spawn(move || {
        let failing = net();
        let mut engine = Engine::new_network(&failing, config).unwrap();
        let mut losses = vec![engine.step_network(&failing, &tiny_batch(0)).unwrap().loss];
        failing.armed.store(true, Ordering::SeqCst);
        let err = engine.step_network(&failing, &tiny_batch(1)).err();
        let _ = said.send(err.map(|e| e.to_string()));
        for s in 1..3 {
            losses.push(engine.step_network(&failing, &tiny_batch(s)).unwrap().loss);
        }
        let _ = ended.send((losses, end(&mut engine, &failing.inner)));
    });
    let err = failed
        .recv_timeout(Duration::from_secs(60))
        .expect("the failed step returned within 60 s")
        .expect("the step failed");
    let (losses, taken) = run
        .recv_timeout(Duration::from_secs(60))
        .expect("the steps after it ended within 60 s");
    (err, losses, taken)
}
