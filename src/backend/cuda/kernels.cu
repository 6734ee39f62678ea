// strata's CUDA kernels, compiled at run time by NVRTC (no headers needed).
// Each one mirrors a CPU function named beside it; tests/kernel_checks
// compares them, on a GPU and on the CPU (that emulator runs each thread in
// turn, so kernels here use no shared memory, barriers, warp functions or
// atomics). Launch: one thread an element, `n` elements.

__device__ __forceinline__ unsigned strata_index() {
    return blockIdx.x * blockDim.x + threadIdx.x;
}

// math::fast_exp::exp_approx, the host's f32 exp, operation for operation
// (Cephes' polynomial, scaled by 2^n through the exponent bits): with no
// fused multiply-adds both give the same bits, which expf and libm's do
// not. Its clamp passes a NaN through, as Rust's f32::clamp does.
__device__ __forceinline__ float strata_exp(float x) {
    const float log2e = 1.44269504088896340736f;
    const float c1 = 0.6933594f;
    const float c2 = -2.1219444e-4f;
    const float round = 12582912.0f;
    if (x < -87.3f) x = -87.3f;
    if (x > 88.0f) x = 88.0f;
    float shifted = x * log2e + round;
    float n = shifted - round;
    float r = (x - n * c1) - n * c2;
    float p = 1.9875691e-4f;
    p = p * r + 1.3982e-3f;
    p = p * r + 8.333452e-3f;
    p = p * r + 4.1665796e-2f;
    p = p * r + 1.6666665e-1f;
    p = p * r + 0.5f;
    float y = p * (r * r) + r + 1.0f;
    unsigned n_bits = __float_as_uint(shifted) - __float_as_uint(round);
    return y * __uint_as_float((n_bits + 127u) << 23);
}

__device__ __forceinline__ float strata_sigmoid(float x) {
    return 1.0f / (1.0f + strata_exp(-x));
}

// math::log_sum_exp of a row of n values (its max, then Σ e^(x − max)).
__device__ __forceinline__ float strata_log_sum_exp(const float* row, unsigned n) {
    float max = row[0];
    for (unsigned j = 1; j < n; ++j) if (row[j] > max) max = row[j];
    float sum = 0.0f;
    for (unsigned j = 0; j < n; ++j) sum += strata_exp(row[j] - max);
    return max + logf(sum);
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

// A row's sums over its columns in STRATA_ROW_LANES interleaved parts,
// one thread a (row, part), so a warp reads a row's columns side by side:
// part l sums columns l, l + 32, l + 64, ... in order, of a² (`product`
// 0), a · g · x (1: a norm's backward) or a · x (2: a gate's backward). strata_row_sum adds a row's
// parts in part order: every thread that asks gets the same bits.
#define STRATA_ROW_LANES 32u
extern "C" __global__ void row_partials(const float* a, const float* x, const float* g,
                                        float* partials, unsigned t, unsigned d,
                                        unsigned product) {
    unsigned long long idx = strata_index();
    if (idx >= (unsigned long long)t * STRATA_ROW_LANES) return;
    unsigned long long i = idx / STRATA_ROW_LANES;
    unsigned lane = idx % STRATA_ROW_LANES;
    const float* ra = a + i * d;
    const float* rx = x + i * d;
    float acc = 0.0f;
    for (unsigned j = lane; j < d; j += STRATA_ROW_LANES)
        acc += product == 0u ? ra[j] * ra[j] : product == 1u ? ra[j] * g[j] * rx[j] : ra[j] * rx[j];
    partials[idx] = acc;
}

__device__ __forceinline__ float strata_row_sum(const float* partials, unsigned long long i) {
    float sum = 0.0f;
    for (unsigned l = 0; l < STRATA_ROW_LANES; ++l) sum += partials[i * STRATA_ROW_LANES + l];
    return sum;
}

// The largest of a row's STRATA_ROW_LANES parts' maxes: the row's max,
// whatever the parts (a max is exact in any order).
__device__ __forceinline__ float strata_parts_max(const float* part) {
    float max = part[0];
    for (unsigned l = 1; l < STRATA_ROW_LANES; ++l)
        if (part[l] > max) max = part[l];
    return max;
}

// math::rmsnorm_forward after row_partials of x², one thread an element:
// out = x · inv_rms · g, each row's inv_rms from its sum of squares (the
// row's first thread writes it).
extern "C" __global__ void rmsnorm_forward(const float* x, const float* g,
                                           const float* partials, float* out, float* inv_rms,
                                           unsigned t, unsigned d, float eps) {
    unsigned long long idx = strata_index();
    if (idx >= (unsigned long long)t * d) return;
    unsigned long long i = idx / d;
    unsigned j = idx % d;
    float inv = 1.0f / sqrtf(strata_row_sum(partials, i) / (float)d + eps);
    if (j == 0) inv_rms[i] = inv;
    out[idx] = x[idx] * inv * g[j];
}

// math::rmsnorm_backward's dx (+=) after row_partials of dout · g · x, one
// thread an element.
extern "C" __global__ void rmsnorm_backward_dx(const float* dout, const float* x, const float* g,
                                               const float* inv_rms, const float* partials,
                                               float* dx, unsigned t, unsigned d) {
    unsigned long long idx = strata_index();
    if (idx >= (unsigned long long)t * d) return;
    unsigned long long i = idx / d;
    unsigned j = idx % d;
    float inv = inv_rms[i];
    float coef = strata_row_sum(partials, i) * inv * inv * inv / (float)d;
    dx[idx] += dout[idx] * g[j] * inv - x[idx] * coef;
}

// A column sum over t rows in two passes, so that every column's sum runs
// on many threads (a norm's gain gradient sums 8192 rows at 16 x 512
// tokens): column_partials sums each block of `rows` rows in row order,
// add_column_partials adds the blocks' sums into dst in block order. The
// summed term is a[i][j], or with `norm` a norm's gain gradient
// dout[i][j] * x[i][j] * inv_rms[i] (math::rmsnorm_backward's dg).
extern "C" __global__ void column_partials(const float* a, const float* x, const float* inv_rms,
                                           float* partials, unsigned t, unsigned d,
                                           unsigned rows, unsigned norm) {
    unsigned idx = strata_index();
    unsigned blocks = (t + rows - 1) / rows;
    if (idx >= blocks * d) return;
    unsigned b = idx / d, j = idx % d;
    unsigned end = (b + 1) * rows < t ? (b + 1) * rows : t;
    float acc = 0.0f;
    for (unsigned i = b * rows; i < end; ++i) {
        unsigned long long at = (unsigned long long)i * d + j;
        acc += norm ? a[at] * x[at] * inv_rms[i] : a[at];
    }
    partials[idx] = acc;
}

// dst[j] += the blocks' partial sums of column j, in block order; one
// thread a column.
extern "C" __global__ void add_column_partials(const float* partials, float* dst, unsigned blocks,
                                               unsigned d) {
    unsigned j = strata_index();
    if (j >= d) return;
    float acc = 0.0f;
    for (unsigned b = 0; b < blocks; ++b) acc += partials[(unsigned long long)b * d + j];
    dst[j] += acc;
}

// lm::attention::rope_forward (sign 1) and rope_backward (sign -1), in
// place, one thread a (row, head, pair): the first 2·half of each head's
// hd dimensions rotate, the rest pass through.
extern "C" __global__ void rope(float* x, const float* cos_table, const float* sin_table,
                                unsigned rows, unsigned heads, unsigned half, unsigned hd,
                                unsigned seq_len, float sign) {
    unsigned idx = strata_index();
    if (idx >= rows * heads * half) return;
    unsigned i = idx % half;
    unsigned h = (idx / half) % heads;
    unsigned t = idx / (half * heads);
    unsigned p = t % seq_len;
    float c = cos_table[p * half + i];
    float s = sign * sin_table[p * half + i];
    float* v = x + ((unsigned long long)t * heads + h) * hd;
    float a = v[i], b = v[i + half];
    v[i] = a * c - b * s;
    v[i + half] = b * c + a * s;
}

// math::cross_entropy_forward_backward over t rows of v logits, in three
// kernels so that a row of a large vocabulary is read by a warp side by
// side: logit_partials takes each row's max (pass `sums` 0) and then its
// sum of e^(x − the row's max) (pass 1) in STRATA_ROW_LANES interleaved
// parts, one thread a (row, part), `partials` holding a row's parts'
// maxes then their sums; cross_entropy_loss adds a row's parts into its
// log-sum-exp and loss share (summed on the host in row order), one
// thread a row; cross_entropy writes d logits, one thread an element. A
// row whose target is math::IGNORED_TARGET (0xFFFFFFFF) adds nothing and
// has zero d logits.
extern "C" __global__ void logit_partials(const float* logits, float* partials, unsigned t,
                                          unsigned v, unsigned sums) {
    unsigned long long idx = strata_index();
    if (idx >= (unsigned long long)t * STRATA_ROW_LANES) return;
    unsigned long long i = idx / STRATA_ROW_LANES;
    unsigned lane = idx % STRATA_ROW_LANES;
    const float* row = logits + i * v;
    float* part = partials + i * 2 * STRATA_ROW_LANES;
    if (!sums) {
        float max = __int_as_float(0xff800000);
        for (unsigned j = lane; j < v; j += STRATA_ROW_LANES)
            if (row[j] > max) max = row[j];
        part[lane] = max;
        return;
    }
    float max = strata_parts_max(part);
    float sum = 0.0f;
    for (unsigned j = lane; j < v; j += STRATA_ROW_LANES) sum += strata_exp(row[j] - max);
    part[STRATA_ROW_LANES + lane] = sum;
}

extern "C" __global__ void cross_entropy_loss(const float* logits, const unsigned* targets,
                                              const float* partials, float* lse,
                                              float* row_loss, unsigned t, unsigned v,
                                              float scale) {
    unsigned long long i = strata_index();
    if (i >= t) return;
    const float* part = partials + i * 2 * STRATA_ROW_LANES;
    float max = strata_parts_max(part);
    float row_lse = max + logf(strata_row_sum(part + STRATA_ROW_LANES, 0));
    lse[i] = row_lse;
    unsigned target = targets[i];
    row_loss[i] = target == 0xFFFFFFFFu ? 0.0f : (row_lse - logits[i * v + target]) * scale;
}

extern "C" __global__ void cross_entropy(const float* logits, const unsigned* targets,
                                         const float* lse, float* dlogits, unsigned t, unsigned v,
                                         float scale) {
    unsigned long long idx = strata_index();
    if (idx >= (unsigned long long)t * v) return;
    unsigned long long i = idx / v;
    unsigned j = idx % v;
    unsigned target = targets[i];
    if (target == 0xFFFFFFFFu) {
        dlogits[idx] = 0.0f;
        return;
    }
    float p = strata_exp(logits[idx] - lse[i]);
    dlogits[idx] = (p - (j == target ? 1.0f : 0.0f)) * scale;
}

// math::gather_forward: rows (n, d) = x[assignment / k], one thread an element.
extern "C" __global__ void gather_rows(const float* x, const unsigned* assignments, float* rows,
                                       unsigned n, unsigned d, unsigned k) {
    unsigned idx = strata_index();
    if (idx >= n * d) return;
    unsigned r = idx / d, c = idx % d;
    rows[idx] = x[(unsigned long long)(assignments[r] / k) * d + c];
}

// math::scatter_to_assignments: dst[assignment] = src row, one thread an element.
extern "C" __global__ void scatter_rows(const float* src, const unsigned* assignments, float* dst,
                                        unsigned n, unsigned d) {
    unsigned idx = strata_index();
    if (idx >= n * d) return;
    unsigned r = idx / d, c = idx % d;
    dst[(unsigned long long)assignments[r] * d + c] = src[idx];
}

// Attention (attention.rs) runs its products through cuBLAS: q, k and v
// are laid out head by head (each head's S x hd rows contiguous), a batched
// GEMM gives a block of query rows their scores against the keys before
// the block's end, and these kernels do the rest. It keeps O(S) a head for
// its backward, not the (S x S) probabilities: each query row's softmax max
// and sum (`stats`, two f32 a row), from which the backward recomputes the
// forward's probabilities bit for bit from the same scores.

// The first key query i of sequence b sees: its document's first token.
__device__ __forceinline__ unsigned strata_attn_first(const unsigned* starts, unsigned long long ti,
                                                      unsigned i) {
    return starts[ti] < i ? starts[ti] : i;
}

// dst (B, H, S, hd) = src (B*S, src_heads*hd) head by head; head h of dst
// is head h / (heads / src_heads) of src (a kv head serves its group).
// One thread an element of dst.
extern "C" __global__ void attn_to_heads(const float* src, float* dst, unsigned seqs, unsigned s,
                                         unsigned heads, unsigned src_heads, unsigned hd) {
    unsigned long long idx = strata_index();
    if (idx >= (unsigned long long)seqs * heads * s * hd) return;
    unsigned c = idx % hd, i = (idx / hd) % s, h = (idx / ((unsigned long long)hd * s)) % heads;
    unsigned long long b = idx / ((unsigned long long)hd * s * heads);
    unsigned g = h / (heads / src_heads);
    dst[idx] = src[((b * s + i) * src_heads + g) * hd + c];
}

// dst (B*S, dst_heads*hd) = src (B, H, S, hd) token by token, each head of
// dst the sum of its group's heads of src in head order (one head a group
// where dst_heads == H); added to dst's values where `accumulate`. One
// thread an element of dst.
extern "C" __global__ void attn_from_heads(const float* src, float* dst, unsigned seqs, unsigned s,
                                           unsigned heads, unsigned dst_heads, unsigned hd,
                                           unsigned accumulate) {
    unsigned long long idx = strata_index();
    if (idx >= (unsigned long long)seqs * s * dst_heads * hd) return;
    unsigned c = idx % hd, g = (idx / hd) % dst_heads;
    unsigned long long t = idx / ((unsigned long long)hd * dst_heads);
    unsigned long long b = t / s, i = t % s;
    unsigned group = heads / dst_heads;
    float sum = 0.0f;
    for (unsigned h = g * group; h < (g + 1) * group; ++h)
        sum += src[((b * heads + h) * s + i) * hd + c];
    dst[idx] = accumulate ? dst[idx] + sum : sum;
}

// The causal softmax of a block of `rows` query rows from q0, for every
// (sequence, head): `scores` holds each row's products with keys 0 ..
// q0 + rows - 1 (row-major, q0 + rows a row), which become the row's
// softmax of products / sqrt(hd) over its own document's keys (first ..=
// i), 0 elsewhere. The forward takes each row's max and sum in
// STRATA_ROW_LANES interleaved parts (attn_softmax_partials, a warp
// reading a row's keys side by side; `partials` holds a row's parts'
// maxes, then their sums), adds the parts into the row's stats
// (attn_softmax_stats: its max and sum), and writes the probabilities
// from the stats (attn_softmax), which the backward does again from the
// same stats, bit for bit.

// Pass `sums` 0: the max of a part's keys' products · scale; pass 1: the
// sum of e^(x · scale − the row's max) over them, the row's max taken
// from pass 0's parts. One thread a (row, part).
extern "C" __global__ void attn_softmax_partials(const float* scores, float* partials,
                                                 const unsigned* starts, unsigned seqs,
                                                 unsigned s, unsigned heads, unsigned hd,
                                                 unsigned q0, unsigned rows, unsigned sums) {
    unsigned long long idx = strata_index();
    if (idx >= (unsigned long long)seqs * heads * rows * STRATA_ROW_LANES) return;
    unsigned long long row_idx = idx / STRATA_ROW_LANES;
    unsigned lane = idx % STRATA_ROW_LANES;
    unsigned r = row_idx % rows;
    unsigned long long bh = row_idx / rows, b = bh / heads;
    unsigned i = q0 + r, keys = q0 + rows;
    unsigned first = strata_attn_first(starts, b * s + i, i);
    // The part's first key at or after `first`.
    unsigned j0 = first + (lane + STRATA_ROW_LANES - first % STRATA_ROW_LANES) % STRATA_ROW_LANES;
    float scale = 1.0f / sqrtf((float)hd);
    const float* row = scores + row_idx * keys;
    float* part = partials + row_idx * 2 * STRATA_ROW_LANES;
    if (!sums) {
        float max = __int_as_float(0xff800000);
        for (unsigned j = j0; j <= i; j += STRATA_ROW_LANES) {
            float x = row[j] * scale;
            if (x > max) max = x;
        }
        part[lane] = max;
        return;
    }
    float max = strata_parts_max(part);
    float sum = 0.0f;
    for (unsigned j = j0; j <= i; j += STRATA_ROW_LANES) sum += strata_exp(row[j] * scale - max);
    part[STRATA_ROW_LANES + lane] = sum;
}

// A row's stats (its max and sum) from its parts, one thread a row.
extern "C" __global__ void attn_softmax_stats(const float* partials, float* stats, unsigned seqs,
                                              unsigned s, unsigned heads, unsigned q0,
                                              unsigned rows) {
    unsigned long long row_idx = strata_index();
    if (row_idx >= (unsigned long long)seqs * heads * rows) return;
    unsigned r = row_idx % rows;
    unsigned long long bh = row_idx / rows;
    const float* part = partials + row_idx * 2 * STRATA_ROW_LANES;
    float max = strata_parts_max(part);
    float* stat = stats + 2 * (bh * s + q0 + r);
    stat[0] = max;
    stat[1] = strata_row_sum(part + STRATA_ROW_LANES, 0);
}

// The probabilities from each row's stats, one thread an element.
extern "C" __global__ void attn_softmax(float* scores, const float* stats, const unsigned* starts,
                                        unsigned seqs, unsigned s, unsigned heads, unsigned hd,
                                        unsigned q0, unsigned rows) {
    unsigned long long idx = strata_index();
    unsigned keys = q0 + rows;
    if (idx >= (unsigned long long)seqs * heads * rows * keys) return;
    unsigned long long row_idx = idx / keys;
    unsigned j = idx % keys;
    unsigned r = row_idx % rows;
    unsigned long long bh = row_idx / rows, b = bh / heads;
    unsigned i = q0 + r;
    unsigned first = strata_attn_first(starts, b * s + i, i);
    float scale = 1.0f / sqrtf((float)hd);
    const float* stat = stats + 2 * (bh * s + i);
    scores[idx] = j >= first && j <= i ? strata_exp(scores[idx] * scale - stat[0]) / stat[1] : 0.0f;
}

// The softmax's backward over a block's rows (as attn_softmax): dp holds
// d probabilities and becomes d products, p * (dp - sum_j p dp) / sqrt(hd).
// attn_softmax_backward_partials takes each row's sum in parts, one thread
// a (row, part); attn_softmax_backward adds them, one thread an element.
extern "C" __global__ void attn_softmax_backward_partials(const float* probs, const float* dp,
                                                          float* partials, unsigned seqs,
                                                          unsigned heads, unsigned q0,
                                                          unsigned rows) {
    unsigned long long idx = strata_index();
    if (idx >= (unsigned long long)seqs * heads * rows * STRATA_ROW_LANES) return;
    unsigned long long row_idx = idx / STRATA_ROW_LANES;
    unsigned lane = idx % STRATA_ROW_LANES;
    unsigned keys = q0 + rows;
    const float* p = probs + row_idx * keys;
    const float* d = dp + row_idx * keys;
    float weighted = 0.0f;
    for (unsigned j = lane; j < keys; j += STRATA_ROW_LANES) weighted += p[j] * d[j];
    partials[idx] = weighted;
}

extern "C" __global__ void attn_softmax_backward(const float* probs, float* dp,
                                                 const float* partials, unsigned seqs,
                                                 unsigned heads, unsigned hd, unsigned q0,
                                                 unsigned rows) {
    unsigned long long idx = strata_index();
    unsigned keys = q0 + rows;
    if (idx >= (unsigned long long)seqs * heads * rows * keys) return;
    float scale = 1.0f / sqrtf((float)hd);
    float weighted = strata_row_sum(partials, idx / keys);
    dp[idx] = probs[idx] * (dp[idx] - weighted) * scale;
}

// The device-resident dense layers' elementwise steps (model::DenseOps).

// acc += x, one thread an element.
extern "C" __global__ void add_into(float* acc, const float* x, unsigned n) {
    unsigned i = strata_index();
    if (i >= n) return;
    acc[i] += x[i];
}

// Each row of x (n / width rows of width) += b, one thread an element.
extern "C" __global__ void add_bias(float* x, const float* b, unsigned n, unsigned width) {
    unsigned i = strata_index();
    if (i >= n) return;
    x[i] += b[i % width];
}

// x clamped to [-clip, clip] in place (a NaN stays NaN, as f32::clamp).
extern "C" __global__ void clamp_values(float* x, unsigned n, float clip) {
    unsigned i = strata_index();
    if (i >= n) return;
    float v = x[i];
    x[i] = v < -clip ? -clip : (v > clip ? clip : v);
}

// grad zeroed where the clamp's input lay outside [-clip, clip] (or was
// NaN): a clamped element passes no gradient.
extern "C" __global__ void clamp_grad(float* grad, const float* before, unsigned n, float clip) {
    unsigned i = strata_index();
    if (i >= n) return;
    float v = before[i];
    if (!(v >= -clip && v <= clip)) grad[i] = 0.0f;
}

// The MoE block's permutation on the device (model::DenseOps, the GPU's
// MoE path). Rows of experts' inputs and outputs are in expert order: row
// i belongs to assignment order[i], and assignment a's row is position[a].

// math::combine_forward: y (t, d) = sum over s < k, in order, of
// weights[i·k + s] · rows[position[i·k + s]], one thread an element.
extern "C" __global__ void combine_rows(const float* rows, const unsigned* position,
                                        const float* weights, float* y, unsigned t, unsigned k,
                                        unsigned d) {
    unsigned idx = strata_index();
    if (idx >= t * d) return;
    unsigned i = idx / d, c = idx % d;
    float acc = 0.0f;
    for (unsigned s = 0; s < k; ++s) {
        unsigned a = i * k + s;
        acc += weights[a] * rows[(unsigned long long)position[a] * d + c];
    }
    y[idx] = acc;
}

// math::combine_backward_weights: dweights[a] = dy[a / k] · rows[position[a]],
// in two passes as a norm's row sums: combine_weights_partials sums the
// product in STRATA_ROW_LANES interleaved parts, one thread an
// (assignment, part), and combine_weights_grad adds an assignment's parts
// in order, one thread an assignment.
extern "C" __global__ void combine_weights_partials(const float* dy, const float* rows,
                                                    const unsigned* position, float* partials,
                                                    unsigned t, unsigned k, unsigned d) {
    unsigned long long idx = strata_index();
    if (idx >= (unsigned long long)t * k * STRATA_ROW_LANES) return;
    unsigned a = idx / STRATA_ROW_LANES, lane = idx % STRATA_ROW_LANES;
    const float* g = dy + (unsigned long long)(a / k) * d;
    const float* r = rows + (unsigned long long)position[a] * d;
    float dot = 0.0f;
    for (unsigned c = lane; c < d; c += STRATA_ROW_LANES) dot += g[c] * r[c];
    partials[idx] = dot;
}

extern "C" __global__ void combine_weights_grad(const float* partials, float* dweights,
                                                unsigned n) {
    unsigned a = strata_index();
    if (a >= n) return;
    dweights[a] = strata_row_sum(partials, a);
}

// math::AssignmentGrads::gather over every row: dst (n, d) row r =
// weights[a] · dy[a / k] for a = order[r], one thread an element.
extern "C" __global__ void weighted_rows(const float* dy, const float* weights,
                                         const unsigned* order, float* dst, unsigned n,
                                         unsigned d, unsigned k) {
    unsigned idx = strata_index();
    if (idx >= n * d) return;
    unsigned r = idx / d, c = idx % d;
    unsigned a = order[r];
    dst[idx] = weights[a] * dy[(unsigned long long)(a / k) * d + c];
}

// math::gather_backward: dx (t, d) += sum over s < k, in order, of
// rows[position[i·k + s]], one thread an element.
extern "C" __global__ void gather_rows_backward(const float* rows, const unsigned* position,
                                                float* dx, unsigned t, unsigned k, unsigned d) {
    unsigned idx = strata_index();
    if (idx >= t * d) return;
    unsigned i = idx / d, c = idx % d;
    float acc = dx[idx];
    for (unsigned s = 0; s < k; ++s) acc += rows[(unsigned long long)position[i * k + s] * d + c];
    dx[idx] = acc;
}

// A batch's rows of S + 1 ids split into its T = B·S inputs and their
// next-token targets, one thread a token: a target whose bit in `mask`
// (position p of the rows at bit p % 32 of word p / 32) is clear is
// math::IGNORED_TARGET; with has_mask 0 every target counts.
extern "C" __global__ void split_token_rows(const unsigned* rows, const unsigned* mask,
                                            unsigned has_mask, unsigned* inputs,
                                            unsigned* targets, unsigned t, unsigned s) {
    unsigned i = strata_index();
    if (i >= t) return;
    unsigned p = i / s * (s + 1) + i % s, next = p + 1;
    inputs[i] = rows[p];
    bool counts = has_mask == 0u || ((mask[next / 32u] >> (next % 32u)) & 1u) != 0u;
    targets[i] = counts ? rows[next] : 0xFFFFFFFFu;
}

// Where each token's document begins in its row (t tokens, rows of s), one
// thread a token, from `begins` (token i at bit i % 32 of word i / 32, set
// where i begins a document; every row's first token is set): the
// nearest set bit at or before the token, skipping clear words whole.
extern "C" __global__ void document_starts(const unsigned* begins, unsigned* starts, unsigned t,
                                           unsigned s) {
    unsigned i = strata_index();
    if (i >= t) return;
    unsigned base = i - i % s, j = i;
    for (;;) {
        unsigned word = begins[j / 32u] & (0xFFFFFFFFu >> (31u - j % 32u));
        if (word != 0u) {
            unsigned bit = j % 32u;
            while (((word >> bit) & 1u) == 0u) --bit;
            starts[i] = j - j % 32u + bit - base;
            return;
        }
        j = j - j % 32u - 1u;  // the last bit of the word before: the row's first is set
    }
}

// The tokens' stable order by id: a merge sort whose passes are parallel
// in the tokens. First each run of `run` tokens is ordered alone
// (`backend::TOKEN_RUN`), one thread a token: token i goes to its run's
// start + (the run's tokens with a smaller id) + (its earlier tokens with
// i's id), so the positions of an id's tokens run in token order.
extern "C" __global__ void token_order_runs(const unsigned* tokens, unsigned* order, unsigned t,
                                            unsigned run) {
    unsigned i = strata_index();
    if (i >= t) return;
    unsigned start = i - i % run;
    unsigned end = start + run < t ? start + run : t;
    unsigned id = tokens[i], rank = start;
    for (unsigned j = start; j < end; ++j) {
        unsigned other = tokens[j];
        rank += (other < id || (other == id && j < i)) ? 1u : 0u;
    }
    order[rank] = i;
}

// One merge pass: each pair of sorted runs of `width` positions in `src`
// (token indices) becomes one sorted run of 2·width in `dst`, one thread a
// position. A token's place is its rank in its own run plus the count of
// the partner run's tokens that go before it, found by binary search: ids
// smaller than its own for a token of the left run, ids no larger for one
// of the right run, so equal ids keep their order (the sort is stable).
extern "C" __global__ void token_order_merge(const unsigned* tokens, const unsigned* src,
                                             unsigned* dst, unsigned t, unsigned width) {
    unsigned p = strata_index();
    if (p >= t) return;
    unsigned long long pair64 = p - p % (2ull * width);
    unsigned pair = (unsigned)pair64;
    unsigned long long mid64 = (unsigned long long)pair + width;
    unsigned long long end64 = mid64 + width;
    unsigned mid = mid64 < t ? (unsigned)mid64 : t, end = end64 < t ? (unsigned)end64 : t;
    unsigned id = tokens[src[p]];
    bool left = p < mid;
    // The partner run [lo, hi): how many of its tokens go before this one.
    unsigned lo = left ? mid : pair, hi = left ? end : mid;
    unsigned a = lo, b = hi;
    while (a < b) {
        unsigned m = a + (b - a) / 2u;
        unsigned other = tokens[src[m]];
        bool before = left ? other < id : other <= id;
        if (before)
            a = m + 1u;
        else
            b = m;
    }
    unsigned own = left ? p - pair : p - mid;
    dst[pair + own + (a - lo)] = src[p];
}

// math::embedding_backward: dtable row id += the dh rows of id's tokens, in
// token order (`order`: the merge sort's above), one thread an element of
// a sorted position's row. Only the first position of an id's run sums, over the
// run: each element sees the cpu loop's sums in its order, and no two
// threads write one element.
extern "C" __global__ void embedding_backward(float* dtable, const float* dh,
                                              const unsigned* tokens, const unsigned* order,
                                              unsigned t, unsigned d) {
    unsigned idx = strata_index();
    if (idx >= t * d) return;
    unsigned j = idx / d, c = idx % d;
    unsigned id = tokens[order[j]];
    if (j > 0 && tokens[order[j - 1]] == id) return;
    float* out = dtable + (unsigned long long)id * d + c;
    float acc = *out;
    for (unsigned k = j; k < t && tokens[order[k]] == id; ++k)
        acc += dh[(unsigned long long)order[k] * d + c];
    *out = acc;
}

// out[0] = the f32 sum of x's n values in index order from 0, one thread:
// a loss's row shares added as the host folds them, 16 loads in flight.
extern "C" __global__ void sum_in_order(const float* x, unsigned n, float* out) {
    if (strata_index() != 0) return;
    float acc = 0.0f;
    unsigned i = 0;
    for (; i + 16u <= n; i += 16u) {
        float v[16];
#pragma unroll
        for (unsigned u = 0; u < 16u; ++u) v[u] = x[i + u];
#pragma unroll
        for (unsigned u = 0; u < 16u; ++u) acc += v[u];
    }
    for (; i < n; ++i) acc += x[i];
    out[0] = acc;
}

// The sum of squares (f64) of each `chunk` elements of x, in index order,
// one thread a chunk: a gradient's norm for clipping, its partial sums
// added on the host.
extern "C" __global__ void square_sums(const float* x, unsigned n, unsigned chunk,
                                       double* out) {
    unsigned i = strata_index();
    unsigned long long start = (unsigned long long)i * chunk;
    if (start >= n) return;
    unsigned long long end = start + chunk < n ? start + chunk : n;
    double acc = 0.0;
    for (unsigned long long j = start; j < end; ++j) {
        double g = (double)x[j];
        acc += g * g;
    }
    out[i] = acc;
}

// math::sigmoid, in place.
extern "C" __global__ void sigmoid_values(float* x, unsigned n) {
    unsigned i = strata_index();
    if (i < n) x[i] = strata_sigmoid(x[i]);
}

// y row r += s[r] · x row r (rows of d), one thread an element: a gated
// shared expert's output added to the residual stream (lm/mlp.rs).
extern "C" __global__ void add_scaled_rows(float* y, const float* x, const float* s, unsigned n,
                                           unsigned d) {
    unsigned i = strata_index();
    if (i < n) y[i] = y[i] + s[i / d] * x[i];
}

// The backward of add_scaled_rows(y, out, sig) with sig = σ(z), one thread
// an element: dout_i = σ_i · dy_i, and each row's first element's thread
// writes dz[i] = σ(1 − σ)·⟨dy_i, out_i⟩, the dot from row_partials' parts
// (product 2) added in part order.
extern "C" __global__ void gate_backward(const float* partials, const float* dy,
                                         const float* sig, float* dz, float* dout, unsigned t,
                                         unsigned d) {
    unsigned long long idx = strata_index();
    if (idx >= (unsigned long long)t * d) return;
    unsigned long long i = idx / d;
    float s = sig[i];
    dout[idx] = s * dy[idx];
    if (idx % d == 0) dz[i] = s * (1.0f - s) * strata_row_sum(partials, i);
}

// A grouped GEMM's device addresses (`cuda/expert_group.rs`), which cuBLAS
// reads from GPU memory: they come as this launch's own argument, as every
// kernel's dimensions do, and one thread copies each of `count` to `out`.
#define STRATA_GROUP_WORDS 48u
struct strata_group_words {
    unsigned long long count;
    unsigned long long words[STRATA_GROUP_WORDS];
};
extern "C" __global__ void group_words(const strata_group_words w, unsigned long long* out) {
    unsigned i = strata_index();
    if (i < w.count && i < STRATA_GROUP_WORDS) out[i] = w.words[i];
}
