// strata's CUDA kernels, compiled at run time by NVRTC (no headers needed).
// Each one mirrors a CPU function named beside it; tests/cuda_backend.rs
// compares them. Launch: one thread an element, `n` elements.

__device__ __forceinline__ unsigned strata_index() {
    return blockIdx.x * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ float strata_sigmoid(float x) {
    return 1.0f / (1.0f + expf(-x));
}

// math::silu(a) * b  (the SwiGLU hidden activation)
extern "C" __global__ void swiglu_forward(const float* a, const float* b, float* h, unsigned n) {
    unsigned i = strata_index();
    if (i < n) {
        float x = a[i];
        h[i] = x * strata_sigmoid(x) * b[i];
    }
}

// d/da and d/db of silu(a) * b (math::silu_grad)
extern "C" __global__ void swiglu_backward(const float* a, const float* b, const float* dh,
                                           float* da, float* db, unsigned n) {
    unsigned i = strata_index();
    if (i < n) {
        float x = a[i];
        float s = strata_sigmoid(x);
        db[i] = dh[i] * (x * s);
        da[i] = dh[i] * b[i] * (s * (1.0f + x * (1.0f - s)));
    }
}

#define STRATA_GELU_K 0.7978845608028654f
#define STRATA_GELU_C 0.044715f

// math::gelu (tanh approximation)
extern "C" __global__ void gelu_forward(const float* a, float* h, unsigned n) {
    unsigned i = strata_index();
    if (i < n) {
        float x = a[i];
        h[i] = 0.5f * x * (1.0f + tanhf(STRATA_GELU_K * (x + STRATA_GELU_C * x * x * x)));
    }
}

// dh * math::gelu_grad(a)
extern "C" __global__ void gelu_backward(const float* a, const float* dh, float* da, unsigned n) {
    unsigned i = strata_index();
    if (i < n) {
        float x = a[i];
        float t = tanhf(STRATA_GELU_K * (x + STRATA_GELU_C * x * x * x));
        float du = STRATA_GELU_K * (1.0f + 3.0f * STRATA_GELU_C * x * x);
        da[i] = dh[i] * (0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du);
    }
}

// half::bf16::from_f32: round to nearest even, NaN kept quiet.
extern "C" __global__ void f32_to_bf16(const float* x, unsigned short* y, unsigned n) {
    unsigned i = strata_index();
    if (i < n) {
        unsigned bits = __float_as_uint(x[i]);
        if ((bits & 0x7fffffffu) > 0x7f800000u) {
            y[i] = (unsigned short)((bits >> 16) | 0x0040u);
        } else {
            unsigned round = 0x7fffu + ((bits >> 16) & 1u);
            y[i] = (unsigned short)((bits + round) >> 16);
        }
    }
}

// strata_optim's scalar AdamW element (adamw_element), fused multiply-adds
// where it has them, so results match it bit for bit (compiled --fmad=false).
extern "C" __global__ void adamw(float* p, float* m, float* v, const float* g, unsigned n,
                                 float grad_scale, float neg_lr_wd, float beta1,
                                 float one_minus_beta1, float beta2, float one_minus_beta2,
                                 float inv_sqrt_bias2, float eps, float neg_step_size) {
    unsigned i = strata_index();
    if (i < n) {
        float gi = g[i] * grad_scale;
        float mi = fmaf(beta1, m[i], one_minus_beta1 * gi);
        float vi = fmaf(beta2, v[i], (one_minus_beta2 * gi) * gi);
        float denom = fmaf(sqrtf(vi), inv_sqrt_bias2, eps);
        float delta = fmaf(neg_step_size, mi / denom, neg_lr_wd * p[i]);
        p[i] = p[i] + delta;
        m[i] = mi;
        v[i] = vi;
    }
}
