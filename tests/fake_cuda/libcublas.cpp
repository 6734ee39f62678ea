// A CPU model of the cuBLAS calls strata makes, for tests only (see
// libcuda.cpp): handles, streams, and cublasGemmEx (also strided-batched
// and grouped) with bf16 or f32 inputs, f32 output and f32 accumulation in
// order of the inner index, column-major as cuBLAS defines it. A GEMM runs in its handle's stream's turn (the CPU
// model of the driver runs each stream on a thread of its own).
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

typedef int cublasStatus_t;
typedef void* cublasHandle_t;
enum : int { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_INVALID_VALUE = 7, CUBLAS_STATUS_NOT_SUPPORTED = 15 };
enum : int { CUDA_R_32F = 0, CUDA_R_16BF = 14 };
enum : int { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };

#define API extern "C" __attribute__((visibility("default")))

// In the CPU model of the driver (libcuda.cpp): runs fn(ctx) in `stream`'s
// turn; counts a launch (each cuBLAS call below counts one, however many
// products it queues).
extern "C" void strata_fake_cuda_enqueue(void* stream, void (*fn)(void*), void* ctx);
extern "C" void strata_fake_cuda_count_launch();

struct Handle {
    void* stream;
};

API cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
    *handle = new Handle{nullptr};
    return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
    delete (Handle*)handle;
    return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasSetStream_v2(cublasHandle_t handle, void* stream) {
    ((Handle*)handle)->stream = stream;
    return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasSetMathMode(cublasHandle_t, int) { return CUBLAS_STATUS_SUCCESS; }
API cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t, void*, size_t) {
    return CUBLAS_STATUS_SUCCESS;
}

static float load(const void* base, int type, long index) {
    if (type == CUDA_R_32F) return ((const float*)base)[index];
    uint32_t bits = (uint32_t)((const uint16_t*)base)[index] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// One GEMM's arguments, copied when it is called (alpha and beta are
// host scalars, read at the call, as in cuBLAS's host pointer mode).
struct Gemm {
    int transa, transb, m, n, k;
    float alpha, beta;
    const void *a, *b;
    int atype, lda, btype, ldb;
    float* c;
    int ldc;
};

static void run_gemm(void* arg) {
    Gemm* g = (Gemm*)arg;
    for (int j = 0; j < g->n; ++j) {
        for (int i = 0; i < g->m; ++i) {
            float acc = 0.0f;
            for (int p = 0; p < g->k; ++p) {
                long ai = g->transa == CUBLAS_OP_N ? i + (long)p * g->lda : p + (long)i * g->lda;
                long bi = g->transb == CUBLAS_OP_N ? p + (long)j * g->ldb : j + (long)p * g->ldb;
                acc += load(g->a, g->atype, ai) * load(g->b, g->btype, bi);
            }
            float* cij = g->c + i + (long)j * g->ldc;
            // beta 0: C is not read (it may hold anything), as in cuBLAS.
            *cij = g->beta == 0.0f ? g->alpha * acc : g->alpha * acc + g->beta * *cij;
        }
    }
    delete g;
}

static cublasStatus_t gemm_ex(cublasHandle_t handle, int transa, int transb, int m, int n, int k,
                              const void* alpha, const void* a, int atype, int lda, const void* b,
                              int btype, int ldb, const void* beta, void* c, int ctype, int ldc,
                              int compute) {
    if (ctype != CUDA_R_32F || (atype != CUDA_R_32F && atype != CUDA_R_16BF) ||
        (btype != CUDA_R_32F && btype != CUDA_R_16BF))
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if (m < 0 || n < 0 || k < 0 || (transa != CUBLAS_OP_N && transa != CUBLAS_OP_T) ||
        (transb != CUBLAS_OP_N && transb != CUBLAS_OP_T))
        return CUBLAS_STATUS_INVALID_VALUE;
    // Leading dimensions as cuBLAS requires them.
    if (lda < (transa == CUBLAS_OP_N ? m : k) || ldb < (transb == CUBLAS_OP_N ? k : n) || ldc < m ||
        lda < 1 || ldb < 1 || ldc < 1)
        return CUBLAS_STATUS_INVALID_VALUE;
    (void)compute;
    Gemm* g = new Gemm{transa, transb, m, n, k, *(const float*)alpha, *(const float*)beta,
                       a, b, atype, lda, btype, ldb, (float*)c, ldc};
    strata_fake_cuda_enqueue(((Handle*)handle)->stream, run_gemm, g);
    return CUBLAS_STATUS_SUCCESS;
}

API cublasStatus_t cublasGemmEx(cublasHandle_t handle, int transa, int transb, int m, int n,
                                int k, const void* alpha, const void* a, int atype, int lda,
                                const void* b, int btype, int ldb, const void* beta, void* c,
                                int ctype, int ldc, int compute, int) {
    strata_fake_cuda_count_launch();
    return gemm_ex(handle, transa, transb, m, n, k, alpha, a, atype, lda, b, btype, ldb, beta, c,
                   ctype, ldc, compute);
}

// cublasGemmEx over `batch` products, each operand's i-th matrix at i
// times its stride (in elements) from its base; run in order, in the
// stream's turn.
API cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, int transa, int transb, int m,
                                              int n, int k, const void* alpha, const void* a,
                                              int atype, int lda, long long stride_a,
                                              const void* b, int btype, int ldb,
                                              long long stride_b, const void* beta, void* c,
                                              int ctype, int ldc, long long stride_c, int batch,
                                              int compute, int algo) {
    if (ctype != CUDA_R_32F || (atype != CUDA_R_32F && atype != CUDA_R_16BF) ||
        (btype != CUDA_R_32F && btype != CUDA_R_16BF))
        return CUBLAS_STATUS_NOT_SUPPORTED;  // f32 or bf16 in, f32 out, as strata asks
    if (batch < 0 || stride_a < 0 || stride_b < 0 || stride_c < 0) return CUBLAS_STATUS_INVALID_VALUE;
    // Strides count elements of each operand's own type.
    long long a_size = atype == CUDA_R_32F ? 4 : 2, b_size = btype == CUDA_R_32F ? 4 : 2;
    (void)algo;
    strata_fake_cuda_count_launch();
    for (int i = 0; i < batch; ++i) {
        cublasStatus_t status =
            gemm_ex(handle, transa, transb, m, n, k, alpha, (const char*)a + i * stride_a * a_size,
                    atype, lda, (const char*)b + i * stride_b * b_size, btype, ldb, beta,
                    (float*)c + i * stride_c, ctype, ldc, compute);
        if (status != CUBLAS_STATUS_SUCCESS) return status;
    }
    return CUBLAS_STATUS_SUCCESS;
}

// cublasGemmGroupedBatchedEx: group i holds group_size[i] products of its
// own transposes, dimensions, leading dimensions, alpha and beta (host
// arrays, read at the call); the products' operand addresses are arrays in
// device memory, read in the stream's turn as cuBLAS reads them. The
// products run in order, each as cublasGemmEx runs it.
struct Grouped {
    std::vector<Gemm> shapes;  // one a product, addresses not yet read
    const void* const* a;
    const void* const* b;
    void* const* c;
};

static void run_grouped(void* arg) {
    Grouped* g = (Grouped*)arg;
    for (size_t p = 0; p < g->shapes.size(); ++p) {
        Gemm* one = new Gemm(g->shapes[p]);
        one->a = g->a[p];
        one->b = g->b[p];
        one->c = (float*)g->c[p];
        run_gemm(one);  // deletes it
    }
    delete g;
}

API cublasStatus_t cublasGemmGroupedBatchedEx(
    cublasHandle_t handle, const int* transa, const int* transb, const int* m, const int* n,
    const int* k, const void* alpha, const void* const* a, int atype, const int* lda,
    const void* const* b, int btype, const int* ldb, const void* beta, void* const* c, int ctype,
    const int* ldc, int group_count, const int* group_size, int compute) {
    if (ctype != CUDA_R_32F || (atype != CUDA_R_32F && atype != CUDA_R_16BF) || btype != atype)
        return CUBLAS_STATUS_NOT_SUPPORTED;  // f32 or bf16 in, f32 out, as strata asks
    if (group_count < 0) return CUBLAS_STATUS_INVALID_VALUE;
    (void)compute;
    strata_fake_cuda_count_launch();
    Grouped* g = new Grouped{{}, a, b, c};
    for (int i = 0; i < group_count; ++i) {
        int ta = transa[i], tb = transb[i];
        if (m[i] < 0 || n[i] < 0 || k[i] < 0 || group_size[i] < 0 ||
            (ta != CUBLAS_OP_N && ta != CUBLAS_OP_T) || (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T) ||
            lda[i] < (ta == CUBLAS_OP_N ? m[i] : k[i]) || ldb[i] < (tb == CUBLAS_OP_N ? k[i] : n[i]) ||
            ldc[i] < m[i] || lda[i] < 1 || ldb[i] < 1 || ldc[i] < 1) {
            delete g;
            return CUBLAS_STATUS_INVALID_VALUE;
        }
        for (int j = 0; j < group_size[i]; ++j)
            g->shapes.push_back(Gemm{ta, tb, m[i], n[i], k[i], ((const float*)alpha)[i],
                                     ((const float*)beta)[i], nullptr, nullptr, atype, lda[i],
                                     btype, ldb[i], nullptr, ldc[i]});
    }
    strata_fake_cuda_enqueue(((Handle*)handle)->stream, run_grouped, g);
    return CUBLAS_STATUS_SUCCESS;
}
