//! The expert-wise optimizer pool: concurrency, errors, splitting, and the
//! global-norm options.

use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::time::Duration;

use half::bf16;
use strata_optim::{
    adamw_step, AdamWHyper, CopyOut, ExpertId, ExpertOptimizer, GradRef, GradientPolicy, Kernel,
    OptimError, OptimizerConfig, StepScalars, UpdateTarget, UpdateViews,
};

/// An expert held in plain vectors, with a bf16 grad and a bf16 copy out.
#[derive(Clone, Debug, PartialEq)]
struct VecExpert {
    params: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    grad: Vec<bf16>,
    copy: Vec<bf16>,
    step: u64,
    panic_in_views: bool,
    /// Calls of `finished`: one per applied update, none for a skipped one.
    finished: u32,
}

impl VecExpert {
    fn new(n: usize, seed: u64) -> Self {
        let value = |i: usize, salt: u64| {
            let x = (i as u64)
                .wrapping_mul(2654435761)
                .wrapping_add(seed * 97 + salt)
                % 10007;
            x as f32 / 10007.0 - 0.5
        };
        Self {
            params: (0..n).map(|i| value(i, 1)).collect(),
            m: vec![0.0; n],
            v: vec![0.0; n],
            grad: (0..n).map(|i| bf16::from_f32(value(i, 2))).collect(),
            copy: vec![bf16::ZERO; n],
            step: 0,
            panic_in_views: false,
            finished: 0,
        }
    }

    /// The same update, done inline with the scalar oracle.
    fn stepped_inline(&self, hyper: &AdamWHyper, grad_scale: f32) -> Self {
        let mut e = self.clone();
        e.step += 1;
        e.finished += 1;
        let s = StepScalars::new(hyper, e.step, grad_scale);
        adamw_step(
            Kernel::Scalar,
            &s,
            &mut e.params,
            &mut e.m,
            &mut e.v,
            GradRef::Bf16(&e.grad),
            CopyOut::Bf16(&mut e.copy),
        )
        .unwrap();
        e
    }
}

impl UpdateTarget for VecExpert {
    fn views(&mut self) -> UpdateViews<'_> {
        assert!(!self.panic_in_views, "a deliberately broken expert");
        UpdateViews {
            params: &mut self.params,
            m: &mut self.m,
            v: &mut self.v,
            grad: GradRef::Bf16(&self.grad),
            copy: CopyOut::Bf16(&mut self.copy),
            step: &mut self.step,
        }
    }

    fn finished(&mut self) {
        self.finished += 1;
    }
}

/// An expert whose gradient arrives from another thread after it was
/// submitted, as a GPU's download does (`UpdateTarget::prepare`).
#[derive(Debug)]
struct ArrivingExpert {
    expert: VecExpert,
    arrival: Option<Receiver<Result<Vec<bf16>, String>>>,
}

impl UpdateTarget for ArrivingExpert {
    fn prepare(&mut self) -> Result<(), String> {
        if let Some(arrival) = self.arrival.take() {
            let waited = arrival.recv_timeout(Duration::from_secs(60));
            self.expert.grad = waited.map_err(|e| format!("no word of it: {e}"))??;
        }
        Ok(())
    }

    fn views(&mut self) -> UpdateViews<'_> {
        self.expert.views()
    }

    fn finished(&mut self) {
        self.expert.finished();
    }
}

fn config(threads: usize) -> OptimizerConfig {
    OptimizerConfig {
        threads,
        queue_len_max: 8,
        in_flight_max: 512,
        split_params_min: 64,
        ..OptimizerConfig::default()
    }
}

#[test]
fn hundreds_of_experts_from_several_threads_while_others_wait() {
    let pool = Arc::new(ExpertOptimizer::<VecExpert>::new(config(3)).unwrap());
    let hyper = pool.config().hyper;
    let submitters = 4;
    let per_thread = 100;
    std::thread::scope(|scope| {
        for t in 0..submitters {
            let pool = Arc::clone(&pool);
            scope.spawn(move || {
                // Each thread submits its experts, waiting for every third
                // one straight away and for the rest at the end, so submits
                // and waits of different experts interleave across threads.
                let mut later = Vec::new();
                for i in 0..per_thread {
                    let key = ExpertId::new(t as u32, i as u32);
                    // Sizes from 1 to ~1000 params: some split, most whole.
                    let expert = VecExpert::new(1 + (i * 37) % 1000, (t * 1000 + i) as u64);
                    let expected = expert.stepped_inline(&hyper, 1.0);
                    pool.submit(key, expert).unwrap();
                    if i % 3 == 0 {
                        let (got, report) = pool.wait(key).unwrap();
                        assert_eq!(got, expected, "expert {key}");
                        assert_eq!(report.step, 1);
                    } else {
                        later.push((key, expected));
                    }
                }
                for (key, expected) in later {
                    let (got, report) = pool.wait(key).unwrap();
                    assert_eq!(got, expected, "expert {key}");
                    assert!(report.chunks >= 1);
                }
            });
        }
    });
    Arc::try_unwrap(pool).ok().unwrap().shutdown().unwrap();
}

/// An update takes the hyperparameters of its submit: `set_hyper` after a
/// submit changes none in flight, and `submit_with` names its own.
#[test]
fn each_update_runs_with_the_hyperparameters_it_was_submitted_with() {
    let pool = ExpertOptimizer::<VecExpert>::new(config(2)).unwrap();
    let first = pool.hyper();
    let second = AdamWHyper {
        lr: first.lr * 3.0,
        weight_decay: 0.1,
        ..first
    };
    let a = VecExpert::new(300, 1);
    let b = VecExpert::new(300, 2);
    let c = VecExpert::new(300, 3);
    let (want_a, want_b, want_c) = (
        a.stepped_inline(&first, 1.0),
        b.stepped_inline(&second, 1.0),
        c.stepped_inline(&first, 1.0),
    );
    assert_ne!(want_a, a.stepped_inline(&second, 1.0));
    pool.submit(ExpertId::new(0, 1), a).unwrap();
    pool.set_hyper(second).unwrap();
    assert_eq!(pool.hyper(), second);
    pool.submit(ExpertId::new(0, 2), b).unwrap();
    pool.submit_with(ExpertId::new(0, 3), c, first).unwrap();
    assert_eq!(pool.wait(ExpertId::new(0, 1)).unwrap().0, want_a);
    assert_eq!(pool.wait(ExpertId::new(0, 2)).unwrap().0, want_b);
    assert_eq!(pool.wait(ExpertId::new(0, 3)).unwrap().0, want_c);
    let bad = AdamWHyper { lr: -1.0, ..first };
    assert!(pool
        .submit_with(ExpertId::new(0, 4), VecExpert::new(8, 4), bad)
        .is_err());
    pool.shutdown().unwrap();
}

#[test]
fn a_panicking_update_is_reported_on_wait_and_the_pool_goes_on() {
    let pool = ExpertOptimizer::<VecExpert>::new(config(2)).unwrap();
    let mut broken = VecExpert::new(10, 1);
    broken.panic_in_views = true;
    pool.submit(ExpertId::new(0, 1), broken).unwrap();
    pool.submit(ExpertId::new(0, 2), VecExpert::new(10, 2))
        .unwrap();
    match pool.wait(ExpertId::new(0, 1)) {
        Err(OptimError::UpdatePanicked { key, message }) => {
            assert_eq!(key, ExpertId::new(0, 1));
            assert!(message.contains("deliberately broken"), "{message}");
        }
        other => panic!("expected a panic report, got {other:?}"),
    }
    assert!(pool.wait(ExpertId::new(0, 2)).is_ok());
    // The key is free again, and the pool still works.
    pool.submit(ExpertId::new(0, 1), VecExpert::new(10, 3))
        .unwrap();
    assert!(pool.wait(ExpertId::new(0, 1)).is_ok());
    pool.shutdown().unwrap();
}

#[test]
fn a_length_mismatch_is_an_error_naming_the_expert() {
    let pool = ExpertOptimizer::<VecExpert>::new(config(1)).unwrap();
    let mut e = VecExpert::new(10, 1);
    e.v.pop();
    pool.submit(ExpertId::new(0, 7), e).unwrap();
    let err = pool.wait(ExpertId::new(0, 7)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "expert 0.7: v has 9 elements but params have 10"
    );
}

#[test]
fn misuse_gets_clear_errors() {
    let mut c = config(1);
    c.in_flight_max = 2;
    let pool = ExpertOptimizer::<VecExpert>::new(c).unwrap();
    assert!(matches!(
        pool.wait(ExpertId::new(0, 3)),
        Err(OptimError::NotSubmitted { .. })
    ));
    pool.submit(ExpertId::new(0, 1), VecExpert::new(4, 1))
        .unwrap();
    assert!(matches!(
        pool.submit(ExpertId::new(0, 1), VecExpert::new(4, 1)),
        Err(OptimError::AlreadySubmitted { .. })
    ));
    pool.submit(ExpertId::new(0, 2), VecExpert::new(4, 1))
        .unwrap();
    assert!(matches!(
        pool.submit(ExpertId::new(0, 3), VecExpert::new(4, 1)),
        Err(OptimError::InFlightFull { in_flight_max: 2 })
    ));
    assert!(matches!(
        pool.finish_gradients(),
        Err(OptimError::InvalidConfig(_))
    ));
    assert!(ExpertOptimizer::<VecExpert>::new(config(0)).is_err());
    // Threads past MAX_THREADS_PER_CORE a core are refused before any starts.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let most = cores * strata_optim::MAX_THREADS_PER_CORE;
    match ExpertOptimizer::<VecExpert>::new(config(most + 1)) {
        Err(OptimError::InvalidConfig(why)) => {
            assert!(why.contains(&format!("machine of {cores} cores")), "{why}")
        }
        other => panic!("{most} + 1 threads: {:?}", other.map(|_| ())),
    }
}

#[test]
fn a_split_expert_equals_the_same_expert_run_whole() {
    let n = 100_003;
    let mut split_cfg = config(3);
    split_cfg.split_params_min = 1000;
    let mut whole_cfg = config(1);
    whole_cfg.split_params_min = usize::MAX / 4;
    let split = ExpertOptimizer::<VecExpert>::new(split_cfg).unwrap();
    let whole = ExpertOptimizer::<VecExpert>::new(whole_cfg).unwrap();
    let mut a = VecExpert::new(n, 5);
    let mut b = a.clone();
    for _ in 0..3 {
        split.submit(ExpertId::new(0, 0), a).unwrap();
        whole.submit(ExpertId::new(0, 0), b).unwrap();
        let (na, ra) = split.wait(ExpertId::new(0, 0)).unwrap();
        let (nb, rb) = whole.wait(ExpertId::new(0, 0)).unwrap();
        assert_eq!(ra.chunks, 12);
        assert_eq!(rb.chunks, 1);
        (a, b) = (na, nb);
    }
    assert_eq!(a, b);
    assert_eq!(a.step, 3);
}

fn global_norm_pool(clip: Option<f32>, skip_nonfinite: bool) -> ExpertOptimizer<VecExpert> {
    let mut c = config(2);
    c.policy = GradientPolicy::GlobalNorm {
        clip_max_norm: clip,
        skip_nonfinite,
    };
    ExpertOptimizer::new(c).unwrap()
}

#[test]
fn global_norm_clipping_scales_every_gradient_exactly() {
    let pool = global_norm_pool(Some(1.0), false);
    let hyper = pool.config().hyper;
    let experts: Vec<VecExpert> = (0..6)
        .map(|i| VecExpert::new(50 + i * 10, i as u64))
        .collect();
    // torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), ≤ 1.
    let norm = experts
        .iter()
        .flat_map(|e| e.grad.iter().map(|g| (g.to_f32() as f64).powi(2)))
        .sum::<f64>()
        .sqrt();
    assert!(norm > 1.0, "the test needs a norm that clips");
    let coef = (1.0 / (norm + 1e-6)) as f32;
    // Submitted in reverse order: the sum is still taken in key order.
    for (i, e) in experts.iter().enumerate().rev() {
        pool.submit(ExpertId::new(0, i as u32), e.clone()).unwrap();
    }
    assert!(matches!(
        pool.wait(ExpertId::new(0, 0)),
        Err(OptimError::AwaitingGradientNorm { .. })
    ));
    let summary = pool.finish_gradients().unwrap();
    assert_eq!(summary.experts, 6);
    assert!((summary.global_norm - norm).abs() <= 1e-9 * norm);
    assert_eq!(summary.grad_scale, coef);
    for (i, e) in experts.iter().enumerate() {
        let (got, report) = pool.wait(ExpertId::new(0, i as u32)).unwrap();
        assert!(!report.skipped);
        assert_eq!(got, e.stepped_inline(&hyper, coef));
    }
}

#[test]
fn global_norm_below_the_clip_leaves_updates_bit_identical() {
    let pool = global_norm_pool(Some(1e9), false);
    let hyper = pool.config().hyper;
    let e = VecExpert::new(300, 9);
    pool.submit(ExpertId::new(0, 0), e.clone()).unwrap();
    assert_eq!(pool.finish_gradients().unwrap().grad_scale, 1.0);
    assert_eq!(
        pool.wait(ExpertId::new(0, 0)).unwrap().0,
        e.stepped_inline(&hyper, 1.0)
    );
}

#[test]
fn a_nonfinite_gradient_skips_the_whole_step() {
    let pool = global_norm_pool(None, true);
    let clean = VecExpert::new(40, 1);
    let mut bad = VecExpert::new(40, 2);
    bad.grad[17] = bf16::INFINITY;
    pool.submit(ExpertId::new(0, 0), clean.clone()).unwrap();
    pool.submit(ExpertId::new(0, 1), bad.clone()).unwrap();
    let summary = pool.finish_gradients().unwrap();
    assert!(summary.skipped);
    assert!(!summary.global_norm.is_finite());
    for (key, before) in [(0, clean), (1, bad)] {
        let (after, report) = pool.wait(ExpertId::new(0, key)).unwrap();
        assert!(report.skipped);
        assert_eq!(after, before, "a skipped step changes nothing");
        assert_eq!(after.step, 0);
    }
}

#[test]
fn an_update_reads_its_gradient_only_once_it_has_arrived() {
    let policies = [
        GradientPolicy::PerExpert,
        GradientPolicy::GlobalNorm {
            clip_max_norm: Some(1e9),
            skip_nonfinite: true,
        },
    ];
    for policy in policies {
        let mut c = config(2);
        c.policy = policy;
        let pool = ExpertOptimizer::<ArrivingExpert>::new(c).unwrap();
        let hyper = pool.config().hyper;
        let key = ExpertId::new(1, 3);
        let gradient = VecExpert::new(300, 2).grad;
        let mut expected = VecExpert::new(300, 1);
        expected.grad = gradient.clone();
        let expected = expected.stepped_inline(&hyper, 1.0);
        // What the buffer holds before the gradient lands: read, it would
        // make every param NaN (and the global norm skip the step).
        let mut submitted = VecExpert::new(300, 1);
        submitted.grad.fill(bf16::NAN);
        let (send, arrival) = channel();
        let arriving = ArrivingExpert {
            expert: submitted,
            arrival: Some(arrival),
        };
        pool.submit(key, arriving).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        send.send(Ok(gradient)).unwrap();
        if policy != GradientPolicy::PerExpert {
            assert_eq!(pool.finish_gradients().unwrap().grad_scale, 1.0);
        }
        let (got, report) = pool.wait(key).unwrap();
        assert!(!report.skipped, "{policy:?}");
        assert_eq!(got.expert, expected, "{policy:?}");
    }
}

#[test]
fn a_gradient_that_never_arrives_fails_its_update_by_name() {
    let pool = ExpertOptimizer::<ArrivingExpert>::new(config(1)).unwrap();
    let (send, arrival) = channel();
    let arriving = ArrivingExpert {
        expert: VecExpert::new(10, 1),
        arrival: Some(arrival),
    };
    pool.submit(ExpertId::new(0, 3), arriving).unwrap();
    send.send(Err("the copy failed".into())).unwrap();
    let err = pool.wait(ExpertId::new(0, 3)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "expert 0.3: its gradient never reached host memory: the copy failed"
    );
    // The pool goes on.
    let (send, arrival) = channel();
    let mut later = VecExpert::new(10, 2);
    later.grad = VecExpert::new(10, 3).grad;
    let expected = later.stepped_inline(&pool.config().hyper, 1.0);
    send.send(Ok(later.grad.clone())).unwrap();
    let arriving = ArrivingExpert {
        expert: later,
        arrival: Some(arrival),
    };
    pool.submit(ExpertId::new(0, 3), arriving).unwrap();
    assert_eq!(pool.wait(ExpertId::new(0, 3)).unwrap().0.expert, expected);
}
