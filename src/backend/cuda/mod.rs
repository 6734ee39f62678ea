//! The CUDA backend (feature `cuda`): cuBLAS GEMMs with bf16 inputs and f32
//! accumulation, NVRTC-compiled kernels for the rest (`kernels.cu`, each
//! mirroring a CPU function), on one compute stream of the GPU.
//!
//! Status: the expert FFN (forward and backward, SwiGLU and GELU), a dense
//! AdamW and the dense layers' kernels (`dense.rs`) run here; as a [`Backend`] the expert FFN takes and returns
//! host slices (inputs uploaded, results downloaded each call). The engine
//! still computes on the cpu backend; wiring this backend and the GPU
//! device tier into the step is the next step.

mod dense;

use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DriverError,
    LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use strata_optim::StepScalars;
use strata_tiers::device_cuda::{open_gpu, GpuInfo};

use super::Backend;
use crate::math::{ExpertKind, ExpertSaved};
use crate::EngineError;

const KERNELS: &str = include_str!("kernels.cu");

fn gpu_error(what: &str, e: impl std::fmt::Display) -> EngineError {
    EngineError::Device {
        device: 0,
        why: format!("{what}: {e}"),
    }
}

struct Functions {
    swiglu_forward: CudaFunction,
    swiglu_backward: CudaFunction,
    gelu_forward: CudaFunction,
    gelu_backward: CudaFunction,
    f32_to_bf16: CudaFunction,
    adamw: CudaFunction,
}

/// One GPU's compute: its context, compute stream, cuBLAS handle, kernels.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    f: Functions,
    dense: dense::DenseFunctions,
    pub info: GpuInfo,
}

/// Row-major GEMM shapes as the CPU backend names them.
#[derive(Clone, Copy)]
struct Shape {
    m: usize,
    k: usize,
    n: usize,
}

impl CudaBackend {
    /// Opens GPU `ordinal` and compiles the kernels; says why when there is
    /// no GPU.
    pub fn new(ordinal: usize) -> Result<Self, EngineError> {
        let (ctx, info) = open_gpu(ordinal)?;
        let stream = ctx
            .new_stream()
            .map_err(|e| gpu_error("creating the compute stream", e))?;
        let blas = CudaBlas::new(Arc::clone(&stream)).map_err(|e| gpu_error("cuBLAS", e))?;
        let ptx = compile_ptx_with_opts(
            KERNELS,
            CompileOptions {
                fmad: Some(false),
                prec_sqrt: Some(true),
                prec_div: Some(true),
                ..CompileOptions::default()
            },
        )
        .map_err(|e| gpu_error("compiling kernels.cu with NVRTC", e))?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| gpu_error("loading the kernels", e))?;
        let load = |name: &str| {
            module
                .load_function(name)
                .map_err(|e| gpu_error(&format!("kernel {name}"), e))
        };
        let f = Functions {
            swiglu_forward: load("swiglu_forward")?,
            swiglu_backward: load("swiglu_backward")?,
            gelu_forward: load("gelu_forward")?,
            gelu_backward: load("gelu_backward")?,
            f32_to_bf16: load("f32_to_bf16")?,
            adamw: load("adamw")?,
        };
        let dense = dense::DenseFunctions::load(&module)?;
        Ok(Self {
            ctx,
            stream,
            blas,
            f,
            dense,
            info,
        })
    }

    fn upload(&self, host: &[f32]) -> Result<CudaSlice<f32>, EngineError> {
        self.stream
            .clone_htod(host)
            .map_err(|e| gpu_error("an upload", e))
    }

    fn zeros(&self, n: usize) -> Result<CudaSlice<f32>, EngineError> {
        self.stream
            .alloc_zeros::<f32>(n)
            .map_err(|e| gpu_error("allocating GPU memory", e))
    }

    fn download(&self, dev: &CudaSlice<f32>, host: &mut [f32]) -> Result<(), EngineError> {
        self.stream
            .memcpy_dtoh(dev, host)
            .map_err(|e| gpu_error("a download", e))
    }

    fn launch_config(n: usize) -> LaunchConfig {
        LaunchConfig::for_num_elems(n as u32)
    }

    /// bf16 copy of `x` (round to nearest even, as `half::bf16::from_f32`).
    fn to_bf16(&self, x: &CudaSlice<f32>) -> Result<CudaSlice<u16>, EngineError> {
        let n = x.len();
        let mut y = self
            .stream
            .alloc_zeros::<u16>(n)
            .map_err(|e| gpu_error("allocating GPU memory", e))?;
        let n32 = n as u32;
        let mut launch = self.stream.launch_builder(&self.f.f32_to_bf16);
        launch.arg(x).arg(&mut y).arg(&n32);
        // SAFETY: the kernel reads n f32 of `x` and writes n u16 of `y`,
        // both allocated with n elements.
        unsafe { launch.launch(Self::launch_config(n)) }
            .map_err(|e| gpu_error("f32_to_bf16", e))?;
        Ok(y)
    }

    /// `c (M, N) = beta·c + a (M, K) · b (N, K)ᵀ` (row-major), bf16 inputs,
    /// f32 accumulation and output. `trans` picks the other products the
    /// backward needs; see `linear_*` below.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        transa: blas_sys::cublasOperation_t,
        transb: blas_sys::cublasOperation_t,
        dims: (usize, usize, usize),
        a: &CudaSlice<u16>,
        lda: usize,
        b: &CudaSlice<u16>,
        ldb: usize,
        beta: f32,
        c: &mut CudaSlice<f32>,
        ldc: usize,
    ) -> Result<(), EngineError> {
        let (m, n, k) = dims;
        let alpha = 1.0f32;
        let (a_ptr, _ra) = a.device_ptr(&self.stream);
        let (b_ptr, _rb) = b.device_ptr(&self.stream);
        let (c_ptr, _rc) = c.device_ptr_mut(&self.stream);
        // SAFETY: the pointers address live allocations whose sizes the
        // callers derive from the same dims and leading dimensions;
        // alpha and beta point to host f32s alive for the call.
        unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                transa,
                transb,
                m as i32,
                n as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                a_ptr as *const _,
                blas_sys::cudaDataType::CUDA_R_16BF,
                lda as i32,
                b_ptr as *const _,
                blas_sys::cudaDataType::CUDA_R_16BF,
                ldb as i32,
                (&beta as *const f32).cast(),
                c_ptr as *mut _,
                blas_sys::cudaDataType::CUDA_R_32F,
                ldc as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| gpu_error("cublasGemmEx", e))
    }

    /// out (M, N) = x (M, K) · w (N, K)ᵀ. Column-major, that is outᵀ =
    /// w·xᵀ: op(A) = wᵀ-stored-as-(K×N) transposed, op(B) = x as (K×M).
    fn linear_forward(
        &self,
        out: &mut CudaSlice<f32>,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        s: Shape,
    ) -> Result<(), EngineError> {
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        self.gemm(
            CUBLAS_OP_T,
            CUBLAS_OP_N,
            (s.n, s.m, s.k),
            w,
            s.k,
            x,
            s.k,
            0.0,
            out,
            s.n,
        )
    }

    /// dx (M, K) += dout (M, N) · w (N, K); dw (N, K) += doutᵀ · x.
    fn linear_backward(
        &self,
        dx: &mut CudaSlice<f32>,
        dw: &mut CudaSlice<f32>,
        dout: &CudaSlice<u16>,
        x: &CudaSlice<u16>,
        w: &CudaSlice<u16>,
        s: Shape,
    ) -> Result<(), EngineError> {
        use blas_sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
        // dxᵀ (K×M) = w-as-(K×N) · doutᵀ-as-(N×M)
        self.gemm(
            CUBLAS_OP_N,
            CUBLAS_OP_N,
            (s.k, s.m, s.n),
            w,
            s.k,
            dout,
            s.n,
            1.0,
            dx,
            s.k,
        )?;
        // dwᵀ (K×N) = x-as-(K×M) · (doutᵀ-as-(N×M))ᵀ
        self.gemm(
            CUBLAS_OP_N,
            CUBLAS_OP_T,
            (s.k, s.n, s.m),
            x,
            s.k,
            dout,
            s.n,
            1.0,
            dw,
            s.k,
        )
    }

    fn elementwise(
        &self,
        f: &CudaFunction,
        what: &str,
        inputs: &[&CudaSlice<f32>],
        outputs: &mut [&mut CudaSlice<f32>],
    ) -> Result<(), EngineError> {
        let n = inputs[0].len();
        let n32 = n as u32;
        let mut launch = self.stream.launch_builder(f);
        for x in inputs {
            launch.arg(*x);
        }
        for y in outputs.iter_mut() {
            launch.arg(&mut **y);
        }
        launch.arg(&n32);
        // SAFETY: every buffer holds n f32 (the callers allocate them from
        // the same shape) and the kernel touches elements 0..n only.
        unsafe { launch.launch(Self::launch_config(n)) }.map_err(|e| gpu_error(what, e))?;
        Ok(())
    }

    /// The dense AdamW on the GPU: the same element update as strata-optim's
    /// scalar kernel (bit for bit), for params, moments and grads already
    /// on the device.
    pub fn adamw(
        &self,
        s: &StepScalars,
        p: &mut CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
        g: &CudaSlice<f32>,
    ) -> Result<(), EngineError> {
        let n = p.len();
        let n32 = n as u32;
        let mut launch = self.stream.launch_builder(&self.f.adamw);
        launch
            .arg(p)
            .arg(m)
            .arg(v)
            .arg(g)
            .arg(&n32)
            .arg(&s.grad_scale)
            .arg(&s.neg_lr_wd)
            .arg(&s.beta1)
            .arg(&s.one_minus_beta1)
            .arg(&s.beta2)
            .arg(&s.one_minus_beta2)
            .arg(&s.inv_sqrt_bias2)
            .arg(&s.eps)
            .arg(&s.neg_step_size);
        // SAFETY: p, m, v, g hold n f32 each (checked by the caller's
        // shapes); the kernel touches elements 0..n.
        unsafe { launch.launch(Self::launch_config(n)) }.map_err(|e| gpu_error("adamw", e))?;
        Ok(())
    }

    /// Host-side AdamW through the GPU (uploads, updates, downloads): what
    /// the tests compare with strata-optim.
    pub fn adamw_host(
        &self,
        s: &StepScalars,
        p: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        g: &[f32],
    ) -> Result<(), EngineError> {
        let (mut dp, mut dm, mut dv) = (self.upload(p)?, self.upload(m)?, self.upload(v)?);
        let dg = self.upload(g)?;
        self.adamw(s, &mut dp, &mut dm, &mut dv, &dg)?;
        self.download(&dp, p)?;
        self.download(&dm, m)?;
        self.download(&dv, v)
    }

    /// Runs one of the element-wise activation kernels on host slices
    /// (tests compare it with the CPU function it mirrors).
    pub fn activation_host(
        &self,
        kind: ExpertKind,
        forward: bool,
        a: &[f32],
        b: &[f32],
        dh: &[f32],
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let n = a.len();
        let da = self.upload(a)?;
        let db = self.upload(b)?;
        let ddh = self.upload(dh)?;
        let mut o1 = self.zeros(n)?;
        let mut o2 = self.zeros(n)?;
        match (kind, forward) {
            (ExpertKind::SwiGlu, true) => self.elementwise(
                &self.f.swiglu_forward,
                "swiglu_forward",
                &[&da, &db],
                &mut [&mut o1],
            )?,
            (ExpertKind::SwiGlu, false) => self.elementwise(
                &self.f.swiglu_backward,
                "swiglu_backward",
                &[&da, &db, &ddh],
                &mut [&mut o1, &mut o2],
            )?,
            (ExpertKind::Gelu, true) => {
                self.elementwise(&self.f.gelu_forward, "gelu_forward", &[&da], &mut [&mut o1])?
            }
            (ExpertKind::Gelu, false) => self.elementwise(
                &self.f.gelu_backward,
                "gelu_backward",
                &[&da, &ddh],
                &mut [&mut o1],
            )?,
        }
        let (mut h1, mut h2) = (vec![0.0; n], vec![0.0; n]);
        self.download(&o1, &mut h1)?;
        self.download(&o2, &mut h2)?;
        Ok(vec![h1, h2])
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }
}

impl Backend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn expert_ffn_forward(
        &self,
        kind: ExpertKind,
        out: &mut [f32],
        saved: &mut ExpertSaved<f32>,
        x: &[f32],
        params: &[f32],
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        let xb = self.to_bf16(&self.upload(x)?)?;
        let w1 = self.to_bf16(&self.upload(&params[..f * d])?)?;
        let w2 = self.to_bf16(&self.upload(&params[params.len() - d * f..])?)?;
        let mut a = self.zeros(n * f)?;
        self.linear_forward(&mut a, &xb, &w1, Shape { m: n, k: d, n: f })?;
        let mut h = self.zeros(n * f)?;
        match kind {
            ExpertKind::SwiGlu => {
                let w3 = self.to_bf16(&self.upload(&params[f * d..2 * f * d])?)?;
                let mut b = self.zeros(n * f)?;
                self.linear_forward(&mut b, &xb, &w3, Shape { m: n, k: d, n: f })?;
                self.elementwise(
                    &self.f.swiglu_forward,
                    "swiglu_forward",
                    &[&a, &b],
                    &mut [&mut h],
                )?;
                saved.b.resize(n * f, 0.0);
                self.download(&b, &mut saved.b)?;
            }
            ExpertKind::Gelu => {
                self.elementwise(&self.f.gelu_forward, "gelu_forward", &[&a], &mut [&mut h])?;
                saved.b.clear();
            }
        }
        let mut y = self.zeros(n * d)?;
        self.linear_forward(&mut y, &self.to_bf16(&h)?, &w2, Shape { m: n, k: f, n: d })?;
        saved.a.resize(n * f, 0.0);
        self.download(&a, &mut saved.a)?;
        self.download(&y, out)
    }

    fn expert_ffn_backward(
        &self,
        kind: ExpertKind,
        dx: &mut [f32],
        dparams: &mut [f32],
        dout: &[f32],
        saved: &ExpertSaved<f32>,
        x: &[f32],
        params: &[f32],
        n: usize,
        d: usize,
        f: usize,
    ) -> Result<(), EngineError> {
        let xb = self.to_bf16(&self.upload(x)?)?;
        let doutb = self.to_bf16(&self.upload(dout)?)?;
        let w1 = self.to_bf16(&self.upload(&params[..f * d])?)?;
        let w2 = self.to_bf16(&self.upload(&params[params.len() - d * f..])?)?;
        let a = self.upload(&saved.a)?;
        let mut h = self.zeros(n * f)?;
        let b = match kind {
            ExpertKind::SwiGlu => {
                let b = self.upload(&saved.b)?;
                self.elementwise(
                    &self.f.swiglu_forward,
                    "swiglu_forward",
                    &[&a, &b],
                    &mut [&mut h],
                )?;
                Some(b)
            }
            ExpertKind::Gelu => {
                self.elementwise(&self.f.gelu_forward, "gelu_forward", &[&a], &mut [&mut h])?;
                None
            }
        };
        let mut ddx = self.zeros(n * d)?; // dx is overwritten, as on the cpu
        let in_len = dparams.len() - d * f;
        let mut dhidden = self.zeros(n * f)?;
        // Each weight's gradient accumulates in a buffer of its own.
        let mut dw2 = self.upload(&dparams[in_len..])?;
        self.linear_backward(
            &mut dhidden,
            &mut dw2,
            &doutb,
            &self.to_bf16(&h)?,
            &w2,
            Shape { m: n, k: f, n: d },
        )?;
        let mut da = self.zeros(n * f)?;
        let mut dw1 = self.upload(&dparams[..f * d])?;
        match (kind, b) {
            (ExpertKind::SwiGlu, Some(b)) => {
                let mut db = self.zeros(n * f)?;
                self.elementwise(
                    &self.f.swiglu_backward,
                    "swiglu_backward",
                    &[&a, &b, &dhidden],
                    &mut [&mut da, &mut db],
                )?;
                let w3 = self.to_bf16(&self.upload(&params[f * d..2 * f * d])?)?;
                let mut dw3 = self.upload(&dparams[f * d..2 * f * d])?;
                let s = Shape { m: n, k: d, n: f };
                self.linear_backward(&mut ddx, &mut dw1, &self.to_bf16(&da)?, &xb, &w1, s)?;
                self.linear_backward(&mut ddx, &mut dw3, &self.to_bf16(&db)?, &xb, &w3, s)?;
                self.download(&dw3, &mut dparams[f * d..2 * f * d])?;
            }
            _ => {
                self.elementwise(
                    &self.f.gelu_backward,
                    "gelu_backward",
                    &[&a, &dhidden],
                    &mut [&mut da],
                )?;
                let s = Shape { m: n, k: d, n: f };
                self.linear_backward(&mut ddx, &mut dw1, &self.to_bf16(&da)?, &xb, &w1, s)?;
            }
        }
        self.download(&dw1, &mut dparams[..f * d])?;
        self.download(&dw2, &mut dparams[in_len..])?;
        self.download(&ddx, dx)?;
        self.stream
            .synchronize()
            .map_err(|e: DriverError| gpu_error("the compute stream", e))
    }
}
