// A CPU model of the cuBLAS calls strata makes, for tests only (see
// libcuda.cpp): handles, streams, and cublasGemmEx with bf16 or f32 inputs,
// f32 output and f32 accumulation in order of the inner index, column-major
// as cuBLAS defines it.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int cublasStatus_t;
typedef void* cublasHandle_t;
enum : int { CUBLAS_STATUS_SUCCESS = 0, CUBLAS_STATUS_INVALID_VALUE = 7, CUBLAS_STATUS_NOT_SUPPORTED = 15 };
enum : int { CUDA_R_32F = 0, CUDA_R_16BF = 14 };
enum : int { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };

#define API extern "C" __attribute__((visibility("default")))

API cublasStatus_t cublasCreate_v2(cublasHandle_t* handle) {
    *handle = malloc(1);
    return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasDestroy_v2(cublasHandle_t handle) {
    free(handle);
    return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasSetStream_v2(cublasHandle_t, void*) { return CUBLAS_STATUS_SUCCESS; }
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

API cublasStatus_t cublasGemmEx(cublasHandle_t, int transa, int transb, int m, int n, int k,
                                const void* alpha, const void* a, int atype, int lda,
                                const void* b, int btype, int ldb, const void* beta, void* c,
                                int ctype, int ldc, int compute, int) {
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
    float al = *(const float*)alpha, be = *(const float*)beta;
    float* out = (float*)c;
    for (int j = 0; j < n; ++j) {
        for (int i = 0; i < m; ++i) {
            float acc = 0.0f;
            for (int p = 0; p < k; ++p) {
                long ai = transa == CUBLAS_OP_N ? i + (long)p * lda : p + (long)i * lda;
                long bi = transb == CUBLAS_OP_N ? p + (long)j * ldb : j + (long)p * ldb;
                acc += load(a, atype, ai) * load(b, btype, bi);
            }
            float* cij = out + i + (long)j * ldc;
            // beta 0: C is not read (it may hold anything), as in cuBLAS.
            *cij = be == 0.0f ? al * acc : al * acc + be * *cij;
        }
    }
    return CUBLAS_STATUS_SUCCESS;
}
