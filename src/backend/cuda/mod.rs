//! The CUDA backend (feature `cuda`): cuBLAS GEMMs with bf16 (or f32)
//! inputs and f32 accumulation (`gemm.rs`), NVRTC-compiled kernels for the
//! rest (`kernels.cu`, each mirroring a CPU function), on one compute
//! stream of the GPU.
//!
//! The expert FFN (`expert.rs`) runs here two ways: on host slices
//! ([`CudaBackend::expert_ffn_forward`], what the tests compare with the
//! plain math), and as the engine's [`super::ExpertDevice`]
//! ([`CudaExpertDevice`]), reading each expert's bf16 params in place from
//! its slot of the GPU device tier, or from rows of activations in GPU
//! memory. The language model's dense layers run here on activations kept
//! in GPU memory ([`CudaOps`], `ops.rs`): GEMMs with bf16 or f32 inputs
//! ([`DenseGemm`], `linear.rs`), causal
//! attention (`attention.rs`, keeping O(S) a head for its backward), the
//! norms, rotary embeddings and the rest (`dense.rs`), each MoE block's
//! router, permutation and combine around its experts (`moe.rs`), and the
//! head with its loss (`head.rs`, in blocks of rows, the logits never
//! leaving the GPU), and the embedding's gather and scatter. With one GPU
//! the dense params stay here and the AdamW kernel steps them
//! (`resident.rs`, [`crate::model::DenseResidence`]). Every copy besides expert
//! params and gradients is counted ([`CudaBackend::pcie_other_bytes`]).

mod attention;
mod attention_host;
mod attention_operands;
mod dense;
mod expert;
mod expert_device;
mod expert_group;
mod gemm;
mod gpu_spans;
mod grad_download;
mod head;
mod linear;
mod moe;
mod ops;
mod resident;
mod router;
mod token_ids;
mod uploads;
mod weights;

pub use attention::{attention_stats_len, ATTENTION_BLOCK_BYTES};
pub use expert_device::CudaExpertDevice;
pub use moe::{CudaMoeSaved, DeviceMoe};
pub use ops::CudaOps;
pub use router::RouterOut;
pub use token_ids::DeviceIds;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::cublas::{sys as blas_sys, CudaBlas};
use cudarc::driver::{
    sys::CUdeviceptr, CudaContext, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut,
    DevicePtr, DeviceRepr, PushKernelArg, ValidAsZeroBits,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use strata_optim::StepScalars;
use strata_tiers::device_cuda::{open_gpu, GpuInfo};

use crate::backend::DenseGemm;
use crate::math::ExpertKind;
use crate::EngineError;

const KERNELS: &str = concat!(include_str!("kernels.cu"), include_str!("router.cu"));

fn gpu_error(what: &str, e: impl std::fmt::Display) -> EngineError {
    EngineError::Device {
        device: 0,
        why: format!("{what}: {e}"),
    }
}

/// Where CUDA's libraries usually are, for the errors that say one is missing.
const TOOLKIT_HINT: &str = ": put the CUDA 13 toolkit's library folder on LD_LIBRARY_PATH, \
     e.g. /usr/local/cuda/lib64 or /usr/local/cuda-13.0/targets/x86_64-linux/lib";

fn missing_library(device: usize, what: &str, file: &str) -> EngineError {
    EngineError::Device {
        device,
        why: format!("no {what} library found ({file} is not on the library path){TOOLKIT_HINT}"),
    }
}

/// Says which of the CUDA libraries beside the driver (NVRTC, cuBLAS) is
/// missing, before cudarc's loaders would panic on it.
pub fn check_libraries(device: usize) -> Result<(), EngineError> {
    // SAFETY: only tries to open the NVRTC library by its known names.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(missing_library(device, "NVRTC", "libnvrtc.so"));
    }
    // SAFETY: as above, for cuBLAS.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(missing_library(device, "cuBLAS", "libcublas.so"));
    }
    Ok(())
}

/// Compiles `kernels.cu` and `router.cu` to PTX with NVRTC (no GPU or driver needed, only
/// the NVRTC library): no fused multiply-adds and IEEE square roots and
/// divisions, so the kernels round as the CPU functions they mirror.
pub fn compile_kernels() -> Result<cudarc::nvrtc::Ptx, EngineError> {
    // SAFETY: only tries to open the NVRTC library by its known names.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(missing_library(0, "NVRTC", "libnvrtc.so"));
    }
    compile_ptx_with_opts(
        KERNELS,
        CompileOptions {
            fmad: Some(false),
            prec_sqrt: Some(true),
            prec_div: Some(true),
            ..CompileOptions::default()
        },
    )
    .map_err(|e| gpu_error("compiling kernels.cu and router.cu with NVRTC", e))
}

/// Lets the device's memory pool keep what the step frees for its next
/// allocations, instead of giving it back to the driver at every
/// synchronization (the pool's default, a release threshold of 0): a step
/// frees and allocates the same activation buffers each micro-batch, and
/// synchronizes after every expert.
fn keep_freed_memory(ctx: &CudaContext) -> Result<(), EngineError> {
    if !ctx.has_async_alloc() {
        return Ok(()); // cudarc allocates synchronously, outside any pool
    }
    ctx.bind_to_thread()
        .map_err(|e| gpu_error("binding the CUDA context", e))?;
    let mut threshold = u64::MAX;
    // SAFETY: the device is the context's own, so its default pool is
    // valid; the release threshold attribute takes a u64, which
    // `threshold` is, alive across the call.
    unsafe {
        let pool = cudarc::driver::result::device::get_default_mem_pool(ctx.cu_device())
            .map_err(|e| gpu_error("the device's memory pool", e))?;
        cudarc::driver::result::mem_pool::set_attribute(
            pool,
            cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .map_err(|e| gpu_error("the device's memory pool", e))
    }
}

struct Functions {
    swiglu_forward: CudaFunction,
    swiglu_backward: CudaFunction,
    gelu_forward: CudaFunction,
    gelu_backward: CudaFunction,
    f32_to_bf16: CudaFunction,
    adamw: CudaFunction,
    group_words: CudaFunction,
}

/// One GPU's compute: its context, compute stream, cuBLAS handle, kernels.
pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    f: Functions,
    dense: dense::DenseFunctions,
    router: router::RouterFunctions,
    /// What the dense GEMMs take as inputs (`linear.rs`).
    dense_gemm: DenseGemm,
    /// The dense weights uploaded since the params last changed.
    weights: std::sync::Mutex<weights::WeightCache<CudaSlice<f32>>>,
    /// bf16 copies of the held weights (keys of `weights`), made at their
    /// first bf16 GEMM after a change (`DenseGemm::Bf16`).
    weights_bf16: std::sync::Mutex<linear::Bf16Copies>,
    /// The dense weight gradients summed on the GPU this step.
    grads: std::sync::Mutex<weights::GradCache<CudaSlice<f32>>>,
    /// The moments of the dense weights stepped here (`resident.rs`).
    resident: std::sync::Mutex<resident::Resident>,
    /// What every layer's attention reads alike (`CudaOps`).
    attention_inputs: std::sync::Mutex<uploads::AttentionInputs>,
    /// Bytes copied between host and GPU other than expert params and
    /// gradients (activations, dense weights and gradients, indices),
    /// since the backend was opened.
    pcie_other: AtomicU64,
    /// Why cuBLAS refused a grouped GEMM (`expert_group.rs`), once it has:
    /// each product then runs alone.
    grouped_gemm_refused: std::sync::OnceLock<String>,
    pub info: GpuInfo,
}

/// Row-major GEMM shapes as the CPU backend names them.
#[derive(Clone, Copy)]
struct Shape {
    m: usize,
    k: usize,
    n: usize,
}

const F32: blas_sys::cudaDataType = blas_sys::cudaDataType::CUDA_R_32F;
const BF16: blas_sys::cudaDataType = blas_sys::cudaDataType::CUDA_R_16BF;

impl CudaBackend {
    /// Opens GPU `ordinal` and compiles the kernels, its dense GEMMs to
    /// take `dense` inputs; says why when there is no GPU.
    pub fn new(ordinal: usize, dense_gemm: DenseGemm) -> Result<Self, EngineError> {
        let (ctx, info) = open_gpu(ordinal)?;
        check_libraries(ordinal)?;
        let stream = ctx
            .new_stream()
            .map_err(|e| gpu_error("creating the compute stream", e))?;
        keep_freed_memory(&ctx)?;
        let blas = CudaBlas::new(Arc::clone(&stream)).map_err(|e| gpu_error("cuBLAS", e))?;
        let ptx = compile_kernels()?;
        let module = ctx
            .load_module(ptx)
            .map_err(|e| gpu_error("loading the kernels", e))?;
        let load = |name: &str| dense::load_kernel(&module, name);
        let f = Functions {
            swiglu_forward: load("swiglu_forward")?,
            swiglu_backward: load("swiglu_backward")?,
            gelu_forward: load("gelu_forward")?,
            gelu_backward: load("gelu_backward")?,
            f32_to_bf16: load("f32_to_bf16")?,
            adamw: load("adamw")?,
            group_words: load("group_words")?,
        };
        let dense = dense::DenseFunctions::load(&module)?;
        let router = router::RouterFunctions::load(&module)?;
        Ok(Self {
            ctx,
            stream,
            blas,
            f,
            dense,
            router,
            dense_gemm,
            weights: Default::default(),
            weights_bf16: Default::default(),
            grads: Default::default(),
            resident: Default::default(),
            attention_inputs: Default::default(),
            pcie_other: AtomicU64::new(0),
            grouped_gemm_refused: std::sync::OnceLock::new(),
            info,
        })
    }

    /// Makes this GPU's context current on the calling thread (device
    /// workers and tests call in from threads of their own).
    fn bind(&self) -> Result<(), EngineError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| gpu_error("binding the CUDA context", e))
    }

    /// Bytes copied between host and GPU by this backend's own transfers
    /// (all but the expert params uploaded into the device tier's slots and
    /// the expert gradients downloaded), since it was opened: the engine's
    /// `StepMetrics::bytes_pcie_other` is a step's difference.
    pub fn pcie_other_bytes(&self) -> u64 {
        self.pcie_other.load(Ordering::Relaxed)
    }

    /// Why cuBLAS refused a grouped GEMM, if it has: a group's products
    /// then run one cublasGemmEx each, the same results.
    pub fn grouped_gemm_refusal(&self) -> Option<&str> {
        self.grouped_gemm_refused.get().map(String::as_str)
    }

    fn refuse_grouped_gemm(&self, why: String) {
        let _ = self.grouped_gemm_refused.set(why); // the first reason stays
    }

    fn count_pcie_other<T>(&self, values: usize) {
        let bytes = (values * std::mem::size_of::<T>()) as u64;
        self.pcie_other.fetch_add(bytes, Ordering::Relaxed);
    }

    fn upload(&self, host: &[f32]) -> Result<CudaSlice<f32>, EngineError> {
        self.upload_values(host)
    }

    fn zeros(&self, n: usize) -> Result<CudaSlice<f32>, EngineError> {
        self.alloc(n)
    }

    /// `n` zeros of `T` in GPU memory.
    pub(super) fn alloc<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, EngineError> {
        self.stream
            .alloc_zeros::<T>(n)
            .map_err(|e| self.memory_error("allocating GPU memory", e))
    }

    /// `host` copied to the GPU, counted in the bytes that cross besides
    /// experts.
    pub(super) fn upload_values<T: DeviceRepr>(
        &self,
        host: &[T],
    ) -> Result<CudaSlice<T>, EngineError> {
        self.count_pcie_other::<T>(host.len());
        self.stream
            .clone_htod(host)
            .map_err(|e| self.memory_error("an upload", e))
    }

    /// `dev` copied into `host`, counted likewise.
    pub(super) fn download_values<T: DeviceRepr>(
        &self,
        dev: &CudaSlice<T>,
        host: &mut [T],
    ) -> Result<(), EngineError> {
        self.count_pcie_other::<T>(host.len());
        self.stream
            .memcpy_dtoh(dev, host)
            .map_err(|e| gpu_error("a download", e))
    }

    /// `e` from `what`, which allocates GPU memory: where the GPU is out
    /// of memory, says how much it has free and what to lower.
    fn memory_error(&self, what: &str, e: cudarc::driver::DriverError) -> EngineError {
        use cudarc::driver::sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY;
        if e.0 != CUDA_ERROR_OUT_OF_MEMORY {
            return gpu_error(what, e);
        }
        let free = match cudarc::driver::result::mem_get_info() {
            Ok((free, total)) => format!("{free} of its {total} bytes are free"),
            Err(_) => "its free memory is unknown".into(),
        };
        gpu_error(
            what,
            format!(
                "the GPU is out of memory ({free}): lower --device-mem, which the expert \
                 slots fill, or --batch or --seq-len (or raise --micro-batches), which set \
                 the activations"
            ),
        )
    }

    /// `x` set to zeros, in stream order.
    fn memset_zeros(&self, x: &mut CudaSlice<f32>) -> Result<(), EngineError> {
        self.stream
            .memset_zeros(x)
            .map_err(|e| gpu_error("zeroing GPU memory", e))
    }

    fn download(&self, dev: &CudaSlice<f32>, host: &mut [f32]) -> Result<(), EngineError> {
        self.download_values(dev, host)
    }

    /// bf16 copy of `x` (round to nearest even, as `half::bf16::from_f32`).
    fn to_bf16(&self, x: &CudaSlice<f32>) -> Result<CudaSlice<u16>, EngineError> {
        let (ptr, _read) = x.device_ptr(&self.stream);
        // SAFETY: `x` holds x.len() f32 and stays alive (and unwritten)
        // while the conversion, queued on this stream, reads it.
        unsafe { self.to_bf16_raw(ptr, x.len()) }
    }

    /// bf16 copy of the `n` f32 at device address `x`.
    ///
    /// # Safety
    /// `x` addresses `n` f32 of this context's memory that nothing writes
    /// until the compute stream has run the conversion.
    unsafe fn to_bf16_raw(&self, x: CUdeviceptr, n: usize) -> Result<CudaSlice<u16>, EngineError> {
        let mut y = self
            .stream
            .alloc_zeros::<u16>(n)
            .map_err(|e| self.memory_error("allocating GPU memory", e))?;
        // SAFETY: the caller's contract, and `y` holds n values.
        unsafe { self.to_bf16_into(&mut y, x, n)? };
        Ok(y)
    }

    /// The first `n` values of `y`: a bf16 copy of the `n` f32 at device
    /// address `x`.
    ///
    /// # Safety
    /// As `to_bf16_raw`'s.
    unsafe fn to_bf16_into(
        &self,
        y: &mut CudaSlice<u16>,
        x: CUdeviceptr,
        n: usize,
    ) -> Result<(), EngineError> {
        assert!(n <= y.len(), "{n} values into a copy of {}", y.len());
        let n32 = n as u32;
        let mut launch = self.stream.launch_builder(&self.f.f32_to_bf16);
        launch.arg(&x).arg(y).arg(&n32);
        // SAFETY: the kernel reads n f32 at `x` (the caller's contract) and
        // writes the first n u16 of `y`, which holds at least n (asserted).
        unsafe { launch.launch(dense::threads(n)) }
            .map(|_| ())
            .map_err(|e| gpu_error("f32_to_bf16", e))
    }

    /// `src` copied to device address `dst`, in stream order.
    ///
    /// # Safety
    /// `dst` addresses `src.len()` values of `T` of this context's memory,
    /// alive and not used by another stream until this stream has run the
    /// copy.
    unsafe fn copy_to<T>(&self, dst: CUdeviceptr, src: &CudaSlice<T>) -> Result<(), EngineError> {
        let (src_ptr, _read) = src.device_ptr(&self.stream);
        let bytes = src.len() * std::mem::size_of::<T>();
        // SAFETY: both address `bytes` of device memory (the contract and
        // the slice's length); the copy is queued on this stream.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(dst, src_ptr, bytes, self.stream.cu_stream())
        }
        .map_err(|e| gpu_error("a copy in GPU memory", e))
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
        unsafe { launch.launch(dense::threads(n)) }.map_err(|e| gpu_error(what, e))?;
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
        let (mut p, mut m, mut v) = (p.slice_mut(..), m.slice_mut(..), v.slice_mut(..));
        self.adamw_view(s, &mut p, &mut m, &mut v, &g.slice(..))
    }

    /// [`Self::adamw`] on views of the params, moments and gradient.
    fn adamw_view(
        &self,
        s: &StepScalars,
        p: &mut CudaViewMut<'_, f32>,
        m: &mut CudaViewMut<'_, f32>,
        v: &mut CudaViewMut<'_, f32>,
        g: &CudaView<'_, f32>,
    ) -> Result<(), EngineError> {
        let n = p.len();
        assert!(m.len() == n && v.len() == n && g.len() == n);
        if n == 0 {
            return Ok(());
        }
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
        // SAFETY: p, m, v, g hold n f32 each (asserted); the kernel
        // touches elements 0..n.
        unsafe { launch.launch(dense::threads(n)) }.map_err(|e| gpu_error("adamw", e))?;
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
