//! kernels.cu run on the CPU: `emulator.cpp` includes it as C++ (with
//! CUDA's index variables and bit casts defined) and exports one launcher
//! per kernel taking cuLaunchKernel's argument array; this module compiles
//! it with the system C++ compiler, loads it, and launches each kernel with
//! the arguments, grid (`LaunchConfig::for_num_elems`: blocks of 1024) and
//! element count that `src/backend/cuda/{mod,dense}.rs` use — a change to a
//! launch there is mirrored here.

use std::ffi::c_void;
use std::path::PathBuf;

use strata::backend::{token_order_merge_widths, ROW_PARTS, TOKEN_RUN};
use strata::math::attention::AttnShape;
use strata::math::{ExpertKind, RouterConfig, Routing};
use strata::model::TokenRows;
use strata_optim::StepScalars;

use super::{KernelHost, MoeRows, RouterResult, ATTENTION_TEST_BLOCK};

#[path = "emulated_attention.rs"]
mod emulated_attention;
#[path = "emulated_router.rs"]
mod emulated_router;

/// kernels.cu built for the CPU and loaded.
pub struct KernelEmulator {
    lib: libloading::Library,
    _dir: tempfile::TempDir,
}

type Launcher = unsafe extern "C" fn(u32, u32, *mut *mut c_void);

/// cuLaunchKernel's form of one argument: a pointer to its value.
fn arg<T>(value: &T) -> *mut c_void {
    (value as *const T).cast_mut().cast()
}

impl KernelEmulator {
    /// Compiles and loads the emulator; `Err` says why it cannot be built
    /// here (no C++ compiler). A compile error is a failure: kernels.cu
    /// must stay plain per-thread C++ that this shim can run.
    pub fn build() -> Result<Self, String> {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let lib_path = dir.path().join("libstrata_kernels_emulated.so");
        let output = std::process::Command::new(&cxx)
            .args([
                "-std=c++17",
                "-O2",
                "-ffp-contract=off",
                "-fPIC",
                "-shared",
                "-I",
            ])
            .arg(root.join("src/backend/cuda"))
            .arg(root.join("tests/kernel_checks/emulator.cpp"))
            .arg("-o")
            .arg(&lib_path)
            .output()
            .map_err(|e| format!("no C++ compiler ({cxx}: {e})"))?;
        assert!(
            output.status.success(),
            "kernels.cu does not build as C++ for the emulator:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        // SAFETY: the library was just built from emulator.cpp, whose only
        // initialization is of plain static variables.
        let lib = unsafe { libloading::Library::new(&lib_path) }.map_err(|e| e.to_string())?;
        Ok(Self { lib, _dir: dir })
    }

    /// Runs `kernel` over `elems` threads (blocks of 1024, as
    /// `LaunchConfig::for_num_elems`).
    pub(crate) fn launch(&self, kernel: &str, elems: usize, args: &[*mut c_void]) {
        let name = format!("strata_launch_{kernel}");
        // SAFETY: every launcher in emulator.cpp has the `Launcher` type.
        let launcher = unsafe { self.lib.get::<Launcher>(name.as_bytes()) }
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut args = args.to_vec();
        // SAFETY: `args` holds one pointer per parameter of `kernel`, to a
        // value of that parameter's type, alive for the call; the buffers
        // they point to have the sizes the kernel indexes for `elems`
        // threads (the callers below size them as the CUDA backend does).
        unsafe { launcher(elems.div_ceil(1024) as u32, 1024, args.as_mut_ptr()) };
    }

    /// `row_partials` of a's t rows (t, d): the 32 parts of each row's
    /// sum of a², or with `product` = (x, g) of a · g · x.
    fn row_partials(
        &self,
        a: &[f32],
        product: Option<(&[f32], &[f32])>,
        t: usize,
        d: usize,
    ) -> Vec<f32> {
        let mut partials = vec![0.0f32; t * ROW_PARTS];
        let (x, g) = product.unwrap_or((a, a));
        let (pa, px, pg, pp) = (a.as_ptr(), x.as_ptr(), g.as_ptr(), partials.as_mut_ptr());
        let [t32, d32, product32] = [t, d, product.is_some() as usize].map(|v| v as u32);
        let args = [
            arg(&pa),
            arg(&px),
            arg(&pg),
            arg(&pp),
            arg(&t32),
            arg(&d32),
            arg(&product32),
        ];
        self.launch("row_partials", t * ROW_PARTS, &args);
        partials
    }
}

impl KernelHost for KernelEmulator {
    fn name(&self) -> &'static str {
        "emulated"
    }

    fn activation(
        &self,
        kind: ExpertKind,
        forward: bool,
        a: &[f32],
        b: &[f32],
        dh: &[f32],
    ) -> Vec<Vec<f32>> {
        let n = a.len();
        let (mut o1, mut o2) = (vec![0.0f32; n], vec![0.0f32; n]);
        let (pa, pb, pdh) = (a.as_ptr(), b.as_ptr(), dh.as_ptr());
        let (p1, p2) = (o1.as_mut_ptr(), o2.as_mut_ptr());
        let n32 = n as u32;
        match (kind, forward) {
            (ExpertKind::SwiGlu, true) => self.launch(
                "swiglu_forward",
                n,
                &[arg(&pa), arg(&pb), arg(&p1), arg(&n32)],
            ),
            (ExpertKind::SwiGlu, false) => self.launch(
                "swiglu_backward",
                n,
                &[arg(&pa), arg(&pb), arg(&pdh), arg(&p1), arg(&p2), arg(&n32)],
            ),
            (ExpertKind::Gelu, true) => {
                self.launch("gelu_forward", n, &[arg(&pa), arg(&p1), arg(&n32)])
            }
            (ExpertKind::Gelu, false) => self.launch(
                "gelu_backward",
                n,
                &[arg(&pa), arg(&pdh), arg(&p1), arg(&n32)],
            ),
        }
        vec![o1, o2]
    }

    fn adamw(&self, s: &StepScalars, p: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32]) {
        let n = p.len();
        assert!(m.len() == n && v.len() == n && g.len() == n);
        let (pp, pm, pv, pg) = (p.as_mut_ptr(), m.as_mut_ptr(), v.as_mut_ptr(), g.as_ptr());
        let n32 = n as u32;
        self.launch(
            "adamw",
            n,
            &[
                arg(&pp),
                arg(&pm),
                arg(&pv),
                arg(&pg),
                arg(&n32),
                arg(&s.grad_scale),
                arg(&s.neg_lr_wd),
                arg(&s.beta1),
                arg(&s.one_minus_beta1),
                arg(&s.beta2),
                arg(&s.one_minus_beta2),
                arg(&s.inv_sqrt_bias2),
                arg(&s.eps),
                arg(&s.neg_step_size),
            ],
        );
    }

    fn rmsnorm_forward(
        &self,
        x: &[f32],
        g: &[f32],
        t: usize,
        d: usize,
        eps: f64,
    ) -> (Vec<f32>, Vec<f32>) {
        assert!(x.len() == t * d && g.len() == d);
        let (mut out, mut inv) = (vec![0.0f32; t * d], vec![0.0f32; t]);
        let partials = self.row_partials(x, None, t, d);
        let (px, pg, po, pi) = (x.as_ptr(), g.as_ptr(), out.as_mut_ptr(), inv.as_mut_ptr());
        let pp = partials.as_ptr();
        let (t32, d32, eps32) = (t as u32, d as u32, eps as f32);
        self.launch(
            "rmsnorm_forward",
            t * d,
            &[
                arg(&px),
                arg(&pg),
                arg(&pp),
                arg(&po),
                arg(&pi),
                arg(&t32),
                arg(&d32),
                arg(&eps32),
            ],
        );
        (out, inv)
    }

    fn rmsnorm_backward(
        &self,
        dx: &mut [f32],
        dg: &mut [f32],
        dout: &[f32],
        x: &[f32],
        g: &[f32],
        inv_rms: &[f32],
        t: usize,
        d: usize,
    ) {
        assert!(dx.len() == t * d && dout.len() == t * d && x.len() == t * d);
        assert!(dg.len() == d && g.len() == d && inv_rms.len() == t);
        let (pdo, px, pg, pi) = (dout.as_ptr(), x.as_ptr(), g.as_ptr(), inv_rms.as_ptr());
        let (pdx, pdg) = (dx.as_mut_ptr(), dg.as_mut_ptr());
        let (t32, d32) = (t as u32, d as u32);
        let partials = self.row_partials(dout, Some((x, g)), t, d);
        let pp = partials.as_ptr();
        self.launch(
            "rmsnorm_backward_dx",
            t * d,
            &[
                arg(&pdo),
                arg(&px),
                arg(&pg),
                arg(&pi),
                arg(&pp),
                arg(&pdx),
                arg(&t32),
                arg(&d32),
            ],
        );
        // dg in two passes, blocks of 8 rows (the backend's are 64), so
        // that the check's rows span several blocks.
        let rows = 8usize;
        let blocks = t.div_ceil(rows);
        let mut partials = vec![0.0f32; blocks * d];
        let ppart = partials.as_mut_ptr();
        let (rows32, norm32, blocks32) = (rows as u32, 1u32, blocks as u32);
        let args = [
            arg(&pdo),
            arg(&px),
            arg(&pi),
            arg(&ppart),
            arg(&t32),
            arg(&d32),
        ];
        let mut args = args.to_vec();
        args.extend([arg(&rows32), arg(&norm32)]);
        self.launch("column_partials", blocks * d, &args);
        let ppart_in = partials.as_ptr();
        let args = [arg(&ppart_in), arg(&pdg), arg(&blocks32), arg(&d32)];
        self.launch("add_column_partials", d, &args);
    }

    fn rope(
        &self,
        x: &mut [f32],
        cos: &[f32],
        sin: &[f32],
        seq_len: usize,
        heads: usize,
        (half, head_dim): (usize, usize),
        transpose: bool,
    ) {
        let rows = x.len() / (heads * head_dim);
        assert!(cos.len() == seq_len * half && sin.len() == seq_len * half);
        let (px, pc, ps) = (x.as_mut_ptr(), cos.as_ptr(), sin.as_ptr());
        let (r32, h32, half32, s32) = (rows as u32, heads as u32, half as u32, seq_len as u32);
        let hd32 = head_dim as u32;
        let sign = if transpose { -1.0f32 } else { 1.0 };
        self.launch(
            "rope",
            rows * heads * half,
            &[
                arg(&px),
                arg(&pc),
                arg(&ps),
                arg(&r32),
                arg(&h32),
                arg(&half32),
                arg(&hd32),
                arg(&s32),
                arg(&sign),
            ],
        );
    }

    fn cross_entropy(
        &self,
        dlogits: &mut [f32],
        logits: &[f32],
        targets: &[u32],
        v: usize,
        denominator: usize,
    ) -> f32 {
        let t = targets.len();
        assert!(logits.len() == t * v && dlogits.len() == t * v);
        // As `CudaBackend::cross_entropy_rows`: each row's parts (max, then
        // sum), its log-sum-exp and loss share, then d logits.
        let (mut partials, mut lse, mut rows) = (
            vec![0.0f32; t * 2 * ROW_PARTS],
            vec![0.0f32; t],
            vec![0.0f32; t],
        );
        let (pl, pt, pd) = (logits.as_ptr(), targets.as_ptr(), dlogits.as_mut_ptr());
        let (pp, pe, pr) = (partials.as_mut_ptr(), lse.as_mut_ptr(), rows.as_mut_ptr());
        let (t32, v32, scale) = (t as u32, v as u32, 1.0f32 / denominator as f32);
        for sums in [0u32, 1] {
            let args = [arg(&pl), arg(&pp), arg(&t32), arg(&v32), arg(&sums)];
            self.launch("logit_partials", t * ROW_PARTS, &args);
        }
        let args = [
            arg(&pl),
            arg(&pt),
            arg(&pp),
            arg(&pe),
            arg(&pr),
            arg(&t32),
            arg(&v32),
            arg(&scale),
        ];
        self.launch("cross_entropy_loss", t, &args);
        let args = [
            arg(&pl),
            arg(&pt),
            arg(&pe),
            arg(&pd),
            arg(&t32),
            arg(&v32),
            arg(&scale),
        ];
        self.launch("cross_entropy", t * v, &args);
        self.sum_in_order(&rows)
    }

    fn sum_in_order(&self, x: &[f32]) -> f32 {
        let mut sum = 0.0f32;
        let (px, ps, n) = (x.as_ptr(), &mut sum as *mut f32, x.len() as u32);
        self.launch("sum_in_order", 1, &[arg(&px), arg(&n), arg(&ps)]);
        sum
    }

    fn token_ids(&self, rows: TokenRows<'_>) -> (Vec<u32>, Vec<u32>) {
        // As `CudaBackend::token_ids_device`.
        let s = rows.seq_len;
        let t = rows.tokens.len() / (s + 1) * s;
        let (mut inputs, mut targets) = (vec![0u32; t], vec![0u32; t]);
        let (mask, has_mask) = match rows.mask_words() {
            Some(words) => (words, 1u32),
            None => (vec![0u32], 0u32),
        };
        let (pr, pm) = (rows.tokens.as_ptr(), mask.as_ptr());
        let (pi, pt) = (inputs.as_mut_ptr(), targets.as_mut_ptr());
        let (t32, s32) = (t as u32, s as u32);
        let args = [arg(&pr), arg(&pm), arg(&has_mask), arg(&pi), arg(&pt)];
        self.launch(
            "split_token_rows",
            t,
            &[&args[..], &[arg(&t32), arg(&s32)]].concat(),
        );
        (inputs, targets)
    }

    fn document_starts(&self, starts: &[u32], seq_len: usize) -> Vec<u32> {
        // As `CudaBackend::attention_starts`: a bit where a token's start is
        // its own position, then the kernel.
        let t = starts.len();
        let mut words = vec![0u32; t.div_ceil(32)];
        for (i, &q) in starts.iter().enumerate() {
            if q as usize == i % seq_len {
                words[i / 32] |= 1 << (i % 32);
            }
        }
        let mut out = vec![0u32; t];
        let (pw, po, t32, s32) = (words.as_ptr(), out.as_mut_ptr(), t as u32, seq_len as u32);
        self.launch(
            "document_starts",
            t,
            &[arg(&pw), arg(&po), arg(&t32), arg(&s32)],
        );
        out
    }

    fn token_order(&self, tokens: &[u32]) -> Vec<u32> {
        // As `CudaBackend::token_order`.
        let t = tokens.len();
        let (mut order, mut merged) = (vec![0u32; t], vec![0u32; t]);
        let (pk, po, t32) = (tokens.as_ptr(), order.as_mut_ptr(), t as u32);
        let run = TOKEN_RUN as u32;
        self.launch(
            "token_order_runs",
            t,
            &[arg(&pk), arg(&po), arg(&t32), arg(&run)],
        );
        for width in token_order_merge_widths(t) {
            let (ps, pm, w32) = (order.as_ptr(), merged.as_mut_ptr(), width as u32);
            let args = [arg(&pk), arg(&ps), arg(&pm), arg(&t32), arg(&w32)];
            self.launch("token_order_merge", t, &args);
            std::mem::swap(&mut order, &mut merged);
        }
        order
    }

    fn embedding_backward(&self, dtable: &mut [f32], dh: &[f32], tokens: &[u32], d: usize) {
        // As `CudaBackend::embedding_backward_device`.
        let t = tokens.len();
        let order = self.token_order(tokens);
        let (pk, t32, d32) = (tokens.as_ptr(), t as u32, d as u32);
        let (pd, ph, po) = (dtable.as_mut_ptr(), dh.as_ptr(), order.as_ptr());
        let args = [arg(&pd), arg(&ph), arg(&pk), arg(&po), arg(&t32), arg(&d32)];
        self.launch("embedding_backward", t * d, &args);
    }

    fn route(
        &self,
        cfg: &RouterConfig,
        logits: &[f32],
        bias: Option<&[f32]>,
        t: usize,
    ) -> RouterResult {
        self.route_emulated(cfg, logits, bias, t)
    }

    fn router_logits_grad(
        &self,
        cfg: &RouterConfig,
        routing: &Routing<f32>,
        dweights: &[f32],
        losses: (f32, f32),
        t: usize,
    ) -> Vec<f32> {
        self.router_logits_grad_emulated(cfg, routing, dweights, losses, t)
    }

    fn add_prob_sums(&self, probs: &[f32], sums: &mut [f64]) {
        self.add_prob_sums_emulated(probs, sums)
    }

    fn aux_prob_grad(&self, counts: &[u32], daux: f32, t: usize, k: usize) -> Vec<f32> {
        // As `CudaBackend::aux_prob_grad_device`.
        let e = counts.len();
        let mut aux = vec![0.0f32; e];
        let (pc, pa) = (counts.as_ptr(), aux.as_mut_ptr());
        let [t32, k32, e32] = [t, k, e].map(|v| v as u32);
        let args = [
            arg(&pc),
            arg(&pa),
            arg(&daux),
            arg(&t32),
            arg(&k32),
            arg(&e32),
        ];
        self.launch("aux_prob_grad", e, &args);
        aux
    }

    fn moe_rows(
        &self,
        rows: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        weights: &[f32],
        order: &[u32],
        position: &[u32],
        (t, k, d): (usize, usize, usize),
    ) -> MoeRows {
        let n = t * k;
        assert!(rows.len() == n * d && dy.len() == t * d && dx.len() == t * d);
        assert!(weights.len() == n && order.len() == n && position.len() == n);
        let mut r = MoeRows {
            y: vec![0.0; t * d],
            dweights: vec![0.0; n],
            dout_rows: vec![0.0; n * d],
        };
        let (prows, pdy, pw, po, pp) = (
            rows.as_ptr(),
            dy.as_ptr(),
            weights.as_ptr(),
            order.as_ptr(),
            position.as_ptr(),
        );
        let (py, pdw, pdo, pdx) = (
            r.y.as_mut_ptr(),
            r.dweights.as_mut_ptr(),
            r.dout_rows.as_mut_ptr(),
            dx.as_mut_ptr(),
        );
        let [t32, k32, d32, n32] = [t, k, d, n].map(|v| v as u32);
        let shape = [arg(&t32), arg(&k32), arg(&d32)];
        let mut args = vec![arg(&prows), arg(&pp), arg(&pw), arg(&py)];
        args.extend(shape);
        self.launch("combine_rows", t * d, &args);
        let mut partials = vec![0.0f32; n * ROW_PARTS];
        let ppart = partials.as_mut_ptr();
        let mut args = vec![arg(&pdy), arg(&prows), arg(&pp), arg(&ppart)];
        args.extend(shape);
        self.launch("combine_weights_partials", n * ROW_PARTS, &args);
        let args = [arg(&ppart), arg(&pdw), arg(&n32)];
        self.launch("combine_weights_grad", n, &args);
        let args = [
            arg(&pdy),
            arg(&pw),
            arg(&po),
            arg(&pdo),
            arg(&n32),
            arg(&d32),
            arg(&k32),
        ];
        self.launch("weighted_rows", n * d, &args);
        let mut args = vec![arg(&prows), arg(&pp), arg(&pdx)];
        args.extend(shape);
        self.launch("gather_rows_backward", t * d, &args);
        r
    }

    fn permute(
        &self,
        x: &[f32],
        assignments: &[u32],
        d: usize,
        k: usize,
        t: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let n = assignments.len();
        assert!(x.len() == t * d && assignments.iter().all(|&a| (a as usize) < t * k));
        let (mut rows, mut scattered) = (vec![0.0f32; n * d], vec![0.0f32; t * k * d]);
        let (px, pa, pr, ps) = (
            x.as_ptr(),
            assignments.as_ptr(),
            rows.as_mut_ptr(),
            scattered.as_mut_ptr(),
        );
        let (n32, d32, k32) = (n as u32, d as u32, k as u32);
        self.launch(
            "gather_rows",
            n * d,
            &[
                arg(&px),
                arg(&pa),
                arg(&pr),
                arg(&n32),
                arg(&d32),
                arg(&k32),
            ],
        );
        let pr_in = rows.as_ptr();
        self.launch(
            "scatter_rows",
            n * d,
            &[arg(&pr_in), arg(&pa), arg(&ps), arg(&n32), arg(&d32)],
        );
        (rows, scattered)
    }

    fn attention_forward(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: &[u32],
        shape: &AttnShape,
    ) -> (Vec<f32>, Vec<f32>) {
        self.attention_forward_blocks(q, k, v, starts, shape, ATTENTION_TEST_BLOCK)
    }

    fn attention_backward(
        &self,
        dq: &mut [f32],
        dk: &mut [f32],
        dv: &mut [f32],
        dout: &[f32],
        stats: &[f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        starts: &[u32],
        shape: &AttnShape,
    ) {
        let (grads, inputs) = ([dq, dk, dv], [dout, stats, q, k, v]);
        self.attention_backward_blocks(grads, inputs, starts, shape, ATTENTION_TEST_BLOCK);
    }
}
