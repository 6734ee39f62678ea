// A CPU model of the CUDA driver API, for tests only: the subset of
// libcuda.so that strata (through cudarc) calls, over host memory. Device
// pointers are host addresses; every stream runs its work on a thread of
// its own, in order, after the call that queued it returns (see below), so
// a missing wait shows; kernels run through the kernel emulator
// (tests/kernel_checks), looked up by name when a module is loaded. It
// checks strata's use of the API (sizes, arguments, ordering, lifetimes)
// and the kernels' results; it says nothing of a real GPU's speed.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

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
    CUDA_ERROR_NOT_READY = 600,
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

static void sync_all_streams();

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
static size_t device_memory_total();
API CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice) {
    *bytes = device_memory_total();
    return CUDA_SUCCESS;
}
// Every attribute reads 0: no memory pools (cudarc then allocates with
// cuMemAlloc), no unified addressing, no special features.
// Memory pools are supported (attribute 115), as on every GPU strata
// targets: allocations are stream-ordered (cuMemAllocAsync, cuMemFreeAsync).
// Every other attribute reads 0.
API CUresult cuDeviceGetAttribute(int* value, int attribute, CUdevice) {
    *value = attribute == 115 ? 1 : 0;
    return CUDA_SUCCESS;
}
// One default pool a device; its attributes are taken and not used (the
// model frees memory when the stream reaches the free).
static int strata_fake_pool;
API CUresult cuDeviceGetDefaultMemPool(void** pool, CUdevice dev) {
    if (dev < 0 || dev >= strata_fake_device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *pool = &strata_fake_pool;
    return CUDA_SUCCESS;
}
API CUresult cuMemPoolSetAttribute(void* pool, int, void* value) {
    return pool == &strata_fake_pool && value ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
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
API CUresult cuCtxSynchronize() {
    sync_all_streams();
    return CUDA_SUCCESS;
}
API CUresult cuCtxGetDevice(CUdevice* dev) {
    if (current_context == nullptr) return CUDA_ERROR_INVALID_VALUE;
    *dev = (int)((int*)current_context - strata_fake_contexts);
    return CUDA_SUCCESS;
}

// Streams run asynchronously, as a GPU's do: each has a thread that runs
// its work in order, after the call that queued it has returned. An event
// is complete once its stream has run everything queued before it was
// recorded; cuStreamWaitEvent queues a wait for that. So a copy read or a
// buffer reused before the wait strata owes it sees another value than on
// the GPU, and a test fails, as it would there. The legacy default stream
// (a null stream) and the synchronous calls wait for every stream first.
// A queue holds at most STREAM_QUEUE_MAX items: a full one blocks the
// caller, as a GPU's launch queue does.
enum { STREAM_QUEUE_MAX = 4096 };

struct Stream {
    std::mutex lock;
    std::condition_variable changed;
    std::deque<std::function<void()>> queue;
    uint64_t queued = 0;  // items ever queued
    uint64_t done = 0;    // items ever finished
    bool stop = false;
    std::thread worker;
    uint64_t id = 0;  // never reused, unlike the address
};

struct Event {
    Stream* stream = nullptr;
    uint64_t stream_id = 0;
    uint64_t ticket = 0;  // complete once stream->done reaches it
    std::chrono::steady_clock::time_point at;
};

static std::mutex streams_lock;
static std::set<Stream*> live_streams;
static uint64_t streams_made = 0;  // under streams_lock

// Whether the stream `e` was recorded on still lives (under streams_lock).
static bool recorded_on_live_stream(const Event* e) {
    return e->stream != nullptr && live_streams.count(e->stream) != 0 &&
           e->stream->id == e->stream_id;
}

// Host joins: calls that return only once a stream (or all of them) has
// run what was queued before them. STRATA_FAKE_CUDA_JOINS names a file
// their count is written to at exit (a measure of how often the host
// waits for the device).
static std::atomic<unsigned long long> host_joins{0};
static void write_joins() {
    const char* path = getenv("STRATA_FAKE_CUDA_JOINS");
    if (!path) return;
    if (FILE* f = fopen(path, "w")) {
        fprintf(f, "%llu\n", host_joins.load());
        fclose(f);
    }
}
static void count_join() {
    static bool registered = atexit(write_joins) == 0;
    (void)registered;
    host_joins += 1;
}

// Launches: kernels, and cuBLAS calls (libcublas.cpp counts each), each
// one call from the host however much work it queues. STRATA_FAKE_CUDA_LAUNCHES
// names a file their count is written to at exit (what a run asks of the
// GPU's launch queue).
static std::atomic<unsigned long long> launches{0};
static void write_launches() {
    const char* path = getenv("STRATA_FAKE_CUDA_LAUNCHES");
    if (!path) return;
    if (FILE* f = fopen(path, "w")) {
        fprintf(f, "%llu\n", launches.load());
        fclose(f);
    }
}
API void strata_fake_cuda_count_launch() {
    static bool registered = atexit(write_launches) == 0;
    (void)registered;
    launches += 1;
}

// Delays a test may set (strata_fake_cuda_set_delays), in microseconds:
// each asynchronous copy between host and device, and each kernel or
// cuBLAS call, sleeps that long in its stream's turn before it runs. A
// stream (or host thread) that reads a copy's destination without waiting
// for the copy's event, or a copy that overwrites what a queued kernel has
// still to read, then sees other bytes every time rather than by chance.
static std::atomic<unsigned> copy_delay_us{0};
static std::atomic<unsigned> compute_delay_us{0};
API void strata_fake_cuda_set_delays(unsigned copies_us, unsigned compute_us) {
    copy_delay_us.store(copies_us);
    compute_delay_us.store(compute_us);
}
static void sleep_us(const std::atomic<unsigned>& delay) {
    unsigned us = delay.load();
    if (us != 0) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

static void stream_run(Stream* s) {
    std::unique_lock<std::mutex> g(s->lock);
    for (;;) {
        s->changed.wait(g, [s] { return s->stop || !s->queue.empty(); });
        if (s->queue.empty()) return;  // stopping, and drained
        std::function<void()> work = std::move(s->queue.front());
        s->queue.pop_front();
        g.unlock();
        work();
        g.lock();
        s->done += 1;
        s->changed.notify_all();
    }
}

static void stream_wait_until(Stream* s, uint64_t ticket) {
    std::unique_lock<std::mutex> g(s->lock);
    s->changed.wait(g, [s, ticket] { return s->done >= ticket; });
}

static uint64_t stream_tail(Stream* s) {
    std::lock_guard<std::mutex> g(s->lock);
    return s->queued;
}

// Holds streams_lock while it waits, so that no stream it waits on is
// destroyed (and freed) under it by another thread; no stream's work takes
// streams_lock, so the streams drain meanwhile.
static void sync_all_streams() {
    count_join();
    std::lock_guard<std::mutex> g(streams_lock);
    std::vector<std::pair<Stream*, uint64_t>> tails;
    for (Stream* s : live_streams) tails.push_back({s, stream_tail(s)});
    for (auto& t : tails) stream_wait_until(t.first, t.second);
}

// Runs `work` on `stream` after everything queued there; on the null
// stream, at once after every stream has drained.
static void enqueue(CUstream stream, std::function<void()> work) {
    if (stream == nullptr) {
        sync_all_streams();
        work();
        return;
    }
    Stream* s = (Stream*)stream;
    std::unique_lock<std::mutex> g(s->lock);
    s->changed.wait(g, [s] { return s->queue.size() < STREAM_QUEUE_MAX; });
    s->queue.push_back(std::move(work));
    s->queued += 1;
    s->changed.notify_all();
}

// For the CPU model of cuBLAS: runs fn(ctx) on `stream` in order.
API void strata_fake_cuda_enqueue(CUstream stream, void (*fn)(void*), void* ctx) {
    enqueue(stream, [fn, ctx] {
        sleep_us(compute_delay_us);
        fn(ctx);
    });
}

static CUresult stream_create(CUstream* stream) {
    Stream* s = new Stream();
    s->worker = std::thread(stream_run, s);
    {
        std::lock_guard<std::mutex> g(streams_lock);
        s->id = ++streams_made;
        live_streams.insert(s);
    }
    *stream = s;
    return CUDA_SUCCESS;
}
API CUresult cuStreamCreate(CUstream* stream, unsigned) { return stream_create(stream); }
API CUresult cuStreamCreateWithPriority(CUstream* stream, unsigned, int) {
    return stream_create(stream);
}
API CUresult cuStreamDestroy_v2(CUstream stream) {
    // As the driver does: work already queued still runs.
    Stream* s = (Stream*)stream;
    {
        std::lock_guard<std::mutex> g(streams_lock);
        live_streams.erase(s);
    }
    {
        std::lock_guard<std::mutex> g(s->lock);
        s->stop = true;
        s->changed.notify_all();
    }
    s->worker.join();
    delete s;
    return CUDA_SUCCESS;
}
API CUresult cuStreamSynchronize(CUstream stream) {
    if (stream == nullptr) {
        sync_all_streams();
    } else {
        count_join();
        Stream* s = (Stream*)stream;
        stream_wait_until(s, stream_tail(s));
    }
    return CUDA_SUCCESS;
}
API CUresult cuStreamQuery(CUstream stream) {
    if (stream == nullptr) return CUDA_SUCCESS;
    Stream* s = (Stream*)stream;
    std::lock_guard<std::mutex> g(s->lock);
    return s->done >= s->queued ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
API CUresult cuStreamWaitEvent(CUstream stream, CUevent event, unsigned) {
    Event* e = (Event*)event;
    Stream* on = e->stream;
    uint64_t ticket = e->ticket;
    if (on == nullptr || on == (Stream*)stream) return CUDA_SUCCESS;  // already in order
    {
        std::lock_guard<std::mutex> g(streams_lock);
        if (!recorded_on_live_stream(e)) return CUDA_SUCCESS;  // complete
    }
    enqueue(stream, [on, ticket] { stream_wait_until(on, ticket); });
    return CUDA_SUCCESS;
}

API CUresult cuEventCreate(CUevent* event, unsigned) {
    Event* e = new Event();
    e->at = std::chrono::steady_clock::now();
    *event = e;
    return CUDA_SUCCESS;
}
API CUresult cuEventDestroy_v2(CUevent event) {
    // The driver frees it once complete, and returns at once: the model
    // frees it in its stream's turn (at once where it was never recorded or
    // its stream is gone, having run all its work). It must not wait, or
    // every event cudarc drops would join the host to a stream, and hide a
    // wait strata owes.
    Event* e = (Event*)event;
    std::lock_guard<std::mutex> g(streams_lock);
    if (recorded_on_live_stream(e))
        enqueue((CUstream)e->stream, [e] { delete e; });
    else
        delete e;
    return CUDA_SUCCESS;
}
API CUresult cuEventRecord(CUevent event, CUstream stream) {
    Event* e = (Event*)event;
    if (stream == nullptr) {
        sync_all_streams();
        e->stream = nullptr;
        e->at = std::chrono::steady_clock::now();
        return CUDA_SUCCESS;
    }
    Stream* s = (Stream*)stream;
    enqueue(stream, [e] { e->at = std::chrono::steady_clock::now(); });
    e->stream = s;
    e->stream_id = s->id;
    e->ticket = stream_tail(s);
    return CUDA_SUCCESS;
}
API CUresult cuEventRecordWithFlags(CUevent event, CUstream stream, unsigned) {
    return cuEventRecord(event, stream);
}
// An event recorded on a stream since destroyed is complete: the stream
// ran all its work first. Both hold streams_lock, as sync_all_streams
// does, so that the stream is not destroyed (and freed) under them.
API CUresult cuEventSynchronize(CUevent event) {
    Event* e = (Event*)event;
    std::lock_guard<std::mutex> g(streams_lock);
    if (recorded_on_live_stream(e)) stream_wait_until(e->stream, e->ticket);
    return CUDA_SUCCESS;
}
API CUresult cuEventQuery(CUevent event) {
    Event* e = (Event*)event;
    std::lock_guard<std::mutex> streams(streams_lock);
    if (!recorded_on_live_stream(e)) return CUDA_SUCCESS;
    std::lock_guard<std::mutex> g(e->stream->lock);
    return e->stream->done >= e->ticket ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}
API CUresult cuEventElapsedTime(float* ms, CUevent start, CUevent end) {
    Event* a = (Event*)start;
    Event* b = (Event*)end;
    if (cuEventQuery(start) != CUDA_SUCCESS || cuEventQuery(end) != CUDA_SUCCESS)
        return CUDA_ERROR_NOT_READY;
    *ms = std::chrono::duration<float, std::milli>(b->at - a->at).count();
    return CUDA_SUCCESS;
}
// CUDA 12.8's name for the same call, which cudarc 0.19 binds.
API CUresult cuEventElapsedTime_v2(float* ms, CUevent start, CUevent end) {
    return cuEventElapsedTime(ms, start, end);
}

// Page-locked host ranges (cuMemHostAlloc, cuMemHostRegister): copies to
// and from them are asynchronous; to and from pageable memory, the driver
// stages them and they are synchronous for the host, as CUDA documents.
static std::mutex pinned_lock;
static std::map<uintptr_t, size_t> pinned;  // start → bytes
static bool is_pinned(const void* p, size_t n) {
    uintptr_t a = (uintptr_t)p;
    std::lock_guard<std::mutex> g(pinned_lock);
    auto it = pinned.upper_bound(a);
    if (it == pinned.begin()) return false;
    --it;
    return a >= it->first && a + n <= it->first + it->second;
}
static void pin(void* p, size_t n) {
    std::lock_guard<std::mutex> g(pinned_lock);
    pinned[(uintptr_t)p] = n;
}
static void unpin(void* p) {
    std::lock_guard<std::mutex> g(pinned_lock);
    pinned.erase((uintptr_t)p);
}

static CUresult host_alloc(void** p, size_t bytes) {
    // 256-byte aligned, as cudaMalloc's pointers are.
    *p = aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
    return *p ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
// Device memory: the bytes allocated, against a total of
// STRATA_FAKE_CUDA_MEMORY bytes (8 GiB unless set), which the device
// reports as its size. An allocation past it fails as the driver's does,
// so a test can hold a run to a device's memory.
static std::mutex device_memory_lock;
static std::map<uintptr_t, size_t> device_allocations;  // start → bytes
static size_t device_in_use = 0;
// The most ever in use, written to the file STRATA_FAKE_CUDA_PEAK names
// at exit (a test compares it with the memory plan).
static size_t device_peak = 0;
static void write_peak() {
    const char* path = getenv("STRATA_FAKE_CUDA_PEAK");
    if (!path) return;
    if (FILE* f = fopen(path, "w")) {
        fprintf(f, "%zu\n", device_peak);
        fclose(f);
    }
}
static size_t device_memory_total() {
    const char* m = getenv("STRATA_FAKE_CUDA_MEMORY");
    return m ? (size_t)strtoull(m, nullptr, 10) : (size_t)8 << 30;
}
// Takes an allocation off the device's count (its memory still valid).
static void uncount(CUdeviceptr dptr) {
    std::lock_guard<std::mutex> g(device_memory_lock);
    auto it = device_allocations.find((uintptr_t)dptr);
    if (it != device_allocations.end()) {
        device_in_use -= it->second;
        device_allocations.erase(it);
    }
}
static void device_free(CUdeviceptr dptr) {
    uncount(dptr);
    free((void*)(uintptr_t)dptr);
}
API CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytes) {
    std::lock_guard<std::mutex> g(device_memory_lock);
    if (device_in_use + bytes > device_memory_total()) return CUDA_ERROR_OUT_OF_MEMORY;
    void* p;
    CUresult rc = host_alloc(&p, bytes);
    *dptr = (CUdeviceptr)(uintptr_t)p;
    if (rc == CUDA_SUCCESS) {
        device_allocations[(uintptr_t)p] = bytes;
        device_in_use += bytes;
        if (device_in_use > device_peak) {
            static bool registered = atexit(write_peak) == 0;
            (void)registered;
            device_peak = device_in_use;
        }
    }
    return rc;
}
API CUresult cuMemAllocAsync(CUdeviceptr* dptr, size_t bytes, CUstream) {
    return cuMemAlloc_v2(dptr, bytes);
}
API CUresult cuMemFree_v2(CUdeviceptr dptr) {
    sync_all_streams();  // cuMemFree waits for the device, as the driver's
    device_free(dptr);
    return CUDA_SUCCESS;
}
// Freed in stream order: the driver's pool hands the bytes to the next
// allocation in that stream's order at once (its work runs after the
// free's), though the memory stays valid for the work queued before the
// free. So the model counts them free when the call is made, and gives
// the memory back in the stream's turn. (Counted so, a host that queues
// the next expert before the last one has run holds no more device memory
// than the GPU's pool would: one expert's temporaries.)
API CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
    if (stream == nullptr) {
        enqueue(stream, [dptr] { device_free(dptr); });
        return CUDA_SUCCESS;
    }
    uncount(dptr);
    enqueue(stream, [dptr] { free((void*)(uintptr_t)dptr); });
    return CUDA_SUCCESS;
}
API CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    std::lock_guard<std::mutex> g(device_memory_lock);
    *total = device_memory_total();
    *free_bytes = *total - device_in_use;
    return CUDA_SUCCESS;
}
API CUresult cuMemsetD8Async(CUdeviceptr dptr, unsigned char value, size_t n, CUstream stream) {
    enqueue(stream, [=] { memset((void*)(uintptr_t)dptr, value, n); });
    return CUDA_SUCCESS;
}
API CUresult cuMemsetD8_v2(CUdeviceptr dptr, unsigned char value, size_t n) {
    return cuMemsetD8Async(dptr, value, n, nullptr);
}
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream stream) {
    if (is_pinned(src, n)) {
        // Read when the copy runs: the host must leave `src` alone till then.
        enqueue(stream, [=] {
            sleep_us(copy_delay_us);
            memcpy((void*)(uintptr_t)dst, src, n);
        });
    } else {
        // Staged at once; the stream writes the device copy in its turn.
        std::shared_ptr<std::vector<char>> staged(new std::vector<char>((const char*)src,
                                                                       (const char*)src + n));
        enqueue(stream, [=] {
            sleep_us(copy_delay_us);
            memcpy((void*)(uintptr_t)dst, staged->data(), n);
        });
    }
    return CUDA_SUCCESS;
}
API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    sync_all_streams();
    memcpy((void*)(uintptr_t)dst, src, n);
    return CUDA_SUCCESS;
}
API CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream stream) {
    enqueue(stream, [=] {
        sleep_us(copy_delay_us);
        memcpy(dst, (const void*)(uintptr_t)src, n);
    });
    if (!is_pinned(dst, n)) cuStreamSynchronize(stream);  // pageable: done on return
    return CUDA_SUCCESS;
}
API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    sync_all_streams();
    memcpy(dst, (const void*)(uintptr_t)src, n);
    return CUDA_SUCCESS;
}
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream stream) {
    enqueue(stream, [=] { memmove((void*)(uintptr_t)dst, (const void*)(uintptr_t)src, n); });
    return CUDA_SUCCESS;
}
API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return cuMemcpyDtoDAsync_v2(dst, src, n, nullptr);
}
API CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned) {
    CUresult rc = host_alloc(p, bytes);
    if (rc == CUDA_SUCCESS) pin(*p, bytes);
    return rc;
}
API CUresult cuMemAllocHost_v2(void** p, size_t bytes) { return cuMemHostAlloc(p, bytes, 0); }
API CUresult cuMemFreeHost(void* p) {
    sync_all_streams();
    unpin(p);
    free(p);
    return CUDA_SUCCESS;
}
// Page-locking: refused when STRATA_FAKE_CUDA_REFUSE_PIN is set, as the
// OS does past the memlock limit (so tests can reach the staging path).
API CUresult cuMemHostRegister_v2(void* p, size_t bytes, unsigned) {
    if (getenv("STRATA_FAKE_CUDA_REFUSE_PIN")) return CUDA_ERROR_OUT_OF_MEMORY;
    pin(p, bytes);
    return CUDA_SUCCESS;
}
API CUresult cuMemHostUnregister(void* p) {
    sync_all_streams();
    unpin(p);
    return CUDA_SUCCESS;
}

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
    strata_binder bind = strata_emulated_binder(name);
    if (bind == nullptr) return CUDA_ERROR_NOT_FOUND;
    *f = (CUfunction)bind;
    return CUDA_SUCCESS;
}
API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                            unsigned by, unsigned bz, unsigned shared, CUstream stream,
                            void** params, void** extra) {
    if (gy != 1 || gz != 1 || by != 1 || bz != 1 || shared != 0 || extra != nullptr)
        return CUDA_ERROR_INVALID_VALUE;
    // The arguments are copied now, as the driver does; the kernel runs in
    // the stream's turn.
    strata_fake_cuda_count_launch();
    std::function<void()> kernel = ((strata_binder)f)(gx, bx, params);
    enqueue(stream, [kernel] {
        sleep_us(compute_delay_us);
        kernel();
    });
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
