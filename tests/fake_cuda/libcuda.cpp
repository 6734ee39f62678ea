// A CPU model of the CUDA driver API, for tests only: the subset of
// libcuda.so that strata (through cudarc) calls, over host memory. Device
// pointers are host addresses; every stream runs its work at once, in call
// order, so an event is complete when recorded and waits return at once;
// kernels run through the kernel emulator (tests/kernel_checks), looked up
// by name when a module is loaded. It checks strata's use of the API
// (sizes, arguments, ordering, lifetimes) and the kernels' results; it says
// nothing of a real GPU's speed or of real asynchrony.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../kernel_checks/emulator.cpp"

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void* CUcontext;
typedef void* CUstream;
typedef void* CUevent;
typedef void* CUmodule;
typedef void* CUfunction;

enum : CUresult {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_NOT_FOUND = 500,
};

// Devices the model can offer; each has its own (primary) context.
// STRATA_FAKE_CUDA_DEVICES (1 to 4) offers fewer, as a one-GPU machine.
enum { STRATA_FAKE_DEVICES = 4 };
static int strata_fake_contexts[STRATA_FAKE_DEVICES];
static int strata_fake_device_count() {
    const char* n = getenv("STRATA_FAKE_CUDA_DEVICES");
    int count = n ? atoi(n) : STRATA_FAKE_DEVICES;
    return count >= 1 && count <= STRATA_FAKE_DEVICES ? count : STRATA_FAKE_DEVICES;
}
static thread_local CUcontext current_context = nullptr;

#define API extern "C" __attribute__((visibility("default")))

API CUresult cuInit(unsigned) { return CUDA_SUCCESS; }
API CUresult cuDriverGetVersion(int* v) {
    *v = 13000;
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetCount(int* n) {
    *n = strata_fake_device_count();
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGet(CUdevice* dev, int ordinal) {
    if (ordinal < 0 || ordinal >= strata_fake_device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetName(char* name, int len, CUdevice) {
    snprintf(name, (size_t)len, "strata CPU model of a CUDA device (tests only)");
    return CUDA_SUCCESS;
}
API CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice) {
    *bytes = (size_t)8 << 30;
    return CUDA_SUCCESS;
}
// Every attribute reads 0: no memory pools (cudarc then allocates with
// cuMemAlloc), no unified addressing, no special features.
API CUresult cuDeviceGetAttribute(int* value, int, CUdevice) {
    *value = 0;
    return CUDA_SUCCESS;
}
API CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice dev) {
    if (dev < 0 || dev >= strata_fake_device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *ctx = &strata_fake_contexts[dev];
    return CUDA_SUCCESS;
}
API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return CUDA_SUCCESS; }
API CUresult cuCtxSetCurrent(CUcontext ctx) {
    current_context = ctx;
    return CUDA_SUCCESS;
}
API CUresult cuCtxGetCurrent(CUcontext* ctx) {
    *ctx = current_context;
    return CUDA_SUCCESS;
}
API CUresult cuCtxSynchronize() { return CUDA_SUCCESS; }
API CUresult cuCtxGetDevice(CUdevice* dev) {
    if (current_context == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *dev = (int)((int*)current_context - strata_fake_contexts);
    return CUDA_SUCCESS;
}

API CUresult cuStreamCreate(CUstream* stream, unsigned) {
    *stream = malloc(1);
    return CUDA_SUCCESS;
}
API CUresult cuStreamCreateWithPriority(CUstream* stream, unsigned, int) {
    *stream = malloc(1);
    return CUDA_SUCCESS;
}
API CUresult cuStreamDestroy_v2(CUstream stream) {
    free(stream);
    return CUDA_SUCCESS;
}
API CUresult cuStreamSynchronize(CUstream) { return CUDA_SUCCESS; }
API CUresult cuStreamQuery(CUstream) { return CUDA_SUCCESS; }
API CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned) { return CUDA_SUCCESS; }

API CUresult cuEventCreate(CUevent* event, unsigned) {
    *event = malloc(1);
    return CUDA_SUCCESS;
}
API CUresult cuEventDestroy_v2(CUevent event) {
    free(event);
    return CUDA_SUCCESS;
}
API CUresult cuEventRecord(CUevent, CUstream) { return CUDA_SUCCESS; }
API CUresult cuEventRecordWithFlags(CUevent, CUstream, unsigned) { return CUDA_SUCCESS; }
API CUresult cuEventSynchronize(CUevent) { return CUDA_SUCCESS; }
API CUresult cuEventQuery(CUevent) { return CUDA_SUCCESS; }
API CUresult cuEventElapsedTime(float* ms, CUevent, CUevent) {
    *ms = 0.0f;
    return CUDA_SUCCESS;
}

static CUresult host_alloc(void** p, size_t bytes) {
    // 256-byte aligned, as cudaMalloc's pointers are.
    *p = aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
    return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
API CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytes) {
    void* p;
    CUresult rc = host_alloc(&p, bytes);
    *dptr = (CUdeviceptr)(uintptr_t)p;
    return rc;
}
API CUresult cuMemAllocAsync(CUdeviceptr* dptr, size_t bytes, CUstream) {
    return cuMemAlloc_v2(dptr, bytes);
}
API CUresult cuMemFree_v2(CUdeviceptr dptr) {
    free((void*)(uintptr_t)dptr);
    return CUDA_SUCCESS;
}
API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream) { return cuMemFree_v2(dptr); }
API CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    *free_bytes = (size_t)8 << 30;
    *total = (size_t)8 << 30;
    return CUDA_SUCCESS;
}
API CUresult cuMemsetD8_v2(CUdeviceptr dptr, unsigned char value, size_t n) {
    memset((void*)(uintptr_t)dptr, value, n);
    return CUDA_SUCCESS;
}
API CUresult cuMemsetD8Async(CUdeviceptr dptr, unsigned char value, size_t n, CUstream) {
    return cuMemsetD8_v2(dptr, value, n);
}
API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    memcpy((void*)(uintptr_t)dst, src, n);
    return CUDA_SUCCESS;
}
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream) {
    return cuMemcpyHtoD_v2(dst, src, n);
}
API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    memcpy(dst, (const void*)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}
API CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream) {
    return cuMemcpyDtoH_v2(dst, src, n);
}
API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    memmove((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream) {
    return cuMemcpyDtoD_v2(dst, src, n);
}
API CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned) { return host_alloc(p, bytes); }
API CUresult cuMemAllocHost_v2(void** p, size_t bytes) { return host_alloc(p, bytes); }
API CUresult cuMemFreeHost(void* p) {
    free(p);
    return CUDA_SUCCESS;
}
// Page-locking: refused when STRATA_FAKE_CUDA_REFUSE_PIN is set, as the
// OS does past the memlock limit (so tests can reach the staging path).
API CUresult cuMemHostRegister_v2(void*, size_t, unsigned) {
    return getenv("STRATA_FAKE_CUDA_REFUSE_PIN") ? CUDA_ERROR_OUT_OF_MEMORY : CUDA_SUCCESS;
}
API CUresult cuMemHostUnregister(void*) { return CUDA_SUCCESS; }

// A module is the set of emulated kernels; its PTX (compiled by the real
// NVRTC) is checked only for being text.
API CUresult cuModuleLoadData(CUmodule* module, const void* image) {
    if (image == nullptr || strstr((const char*)image, ".entry") == nullptr)
        return CUDA_ERROR_INVALID_VALUE;
    *module = (CUmodule)strata_emulated_kernel;
    return CUDA_SUCCESS;
}
API CUresult cuModuleUnload(CUmodule) { return CUDA_SUCCESS; }
API CUresult cuModuleGetFunction(CUfunction* f, CUmodule, const char* name) {
    strata_launcher launch = strata_emulated_kernel(name);
    if (launch == nullptr) return CUDA_ERROR_NOT_FOUND;
    *f = (CUfunction)launch;
    return CUDA_SUCCESS;
}
API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                            unsigned by, unsigned bz, unsigned shared, CUstream, void** params,
                            void** extra) {
    if (gy != 1 || gz != 1 || by != 1 || bz != 1 || shared != 0 || extra != nullptr)
        return CUDA_ERROR_INVALID_VALUE;
    ((strata_launcher)f)(gx, bx, params);
    return CUDA_SUCCESS;
}

API CUresult cuGetErrorString(CUresult rc, const char** text) {
    *text = rc == CUDA_SUCCESS ? "no error" : "an error in the CPU model of CUDA";
    return CUDA_SUCCESS;
}
API CUresult cuGetErrorName(CUresult rc, const char** text) {
    *text = rc == CUDA_SUCCESS ? "CUDA_SUCCESS" : "CUDA_ERROR";
    return CUDA_SUCCESS;
}
