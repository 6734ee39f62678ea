// A CPU model of the part of NCCL strata calls (NcclComm, src/comm/nccl.rs),
// for tests only, beside the CPU model of the driver (libcuda.cpp): device
// pointers are host addresses there, and each stream runs its work on a
// thread, which this library queues its transfers on
// (strata_fake_cuda_enqueue). Ranks are processes on one machine; each pair
// is joined by a Unix socket in a directory the unique id names.
//
// What it keeps of NCCL's contract: ncclCommInitRank returns once every
// rank has joined; sends and receives queued between ncclGroupStart and
// ncclGroupEnd run together, in the stream's order, after the call has
// returned; a receive of another size than its send fails the
// communicator; a peer whose process ended fails the collective in flight
// (ncclCommGetAsyncError says so) instead of hanging it; ncclCommAbort ends
// the transfers still waiting.

#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#define API extern "C" __attribute__((visibility("default")))

extern "C" void strata_fake_cuda_enqueue(void* stream, void (*fn)(void*), void* ctx);

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
} ncclResult_t;

typedef struct {
    char internal[128];
} ncclUniqueId;

static const char MAGIC[] = "strata-fake-nccl:";
// How long a rank waits for its peers to join, and how often it retries.
static const int JOIN_TIMEOUT_MS = 60000;

struct Comm {
    int rank = 0;
    int size = 0;
    std::vector<int> fds;  // [peer] the socket to it; -1 for this rank
    std::atomic<int> error{ncclSuccess};
    std::atomic<bool> aborted{false};
};
typedef Comm* ncclComm_t;

struct Op {
    bool send;
    char* ptr;
    size_t bytes;
    int peer;
};

struct Job {
    Comm* comm;
    std::vector<Op> ops;
};

static thread_local int group_depth = 0;
static thread_local std::vector<Op> pending;
static thread_local Comm* pending_comm = nullptr;
static thread_local void* pending_stream = nullptr;

API ncclResult_t ncclGetVersion(int* version) {
    *version = 23000;
    return ncclSuccess;
}

API const char* ncclGetErrorString(ncclResult_t r) {
    switch (r) {
        case ncclSuccess: return "no error";
        case ncclSystemError: return "system error (fake NCCL)";
        case ncclRemoteError: return "remote error: a peer stopped (fake NCCL)";
        case ncclInvalidArgument: return "invalid argument (fake NCCL)";
        case ncclInvalidUsage: return "invalid usage (fake NCCL)";
        default: return "error (fake NCCL)";
    }
}

API const char* ncclGetLastError(ncclComm_t) { return ""; }

API ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    char dir[] = "/tmp/strata-fake-nccl-XXXXXX";
    if (mkdtemp(dir) == nullptr) return ncclSystemError;
    memset(id->internal, 0, sizeof(id->internal));
    snprintf(id->internal, sizeof(id->internal), "%s%s", MAGIC, dir);
    return ncclSuccess;
}

static std::string socket_path(const std::string& dir, int rank) {
    return dir + "/" + std::to_string(rank);
}

static bool write_all(int fd, const char* p, size_t n) {
    while (n > 0) {
        ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return false;
        p += w;
        n -= (size_t)w;
    }
    return true;
}

static bool read_all(int fd, char* p, size_t n) {
    while (n > 0) {
        ssize_t r = recv(fd, p, n, 0);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return false;
        p += r;
        n -= (size_t)r;
    }
    return true;
}

static int listen_at(const std::string& path) {
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
    unlink(path.c_str());
    if (bind(fd, (sockaddr*)&addr, sizeof(addr)) != 0 || listen(fd, 64) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

static int connect_to(const std::string& path, std::chrono::steady_clock::time_point deadline) {
    for (;;) {
        int fd = socket(AF_UNIX, SOCK_STREAM, 0);
        if (fd < 0) return -1;
        sockaddr_un addr{};
        addr.sun_family = AF_UNIX;
        snprintf(addr.sun_path, sizeof(addr.sun_path), "%s", path.c_str());
        if (connect(fd, (sockaddr*)&addr, sizeof(addr)) == 0) return fd;
        close(fd);
        if (std::chrono::steady_clock::now() > deadline) return -1;
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
}

API ncclResult_t ncclCommInitRank(ncclComm_t* out, int nranks, ncclUniqueId id, int rank) {
    if (strncmp(id.internal, MAGIC, strlen(MAGIC)) != 0) return ncclInvalidArgument;
    if (nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
    std::string dir(id.internal + strlen(MAGIC));
    mkdir(dir.c_str(), 0700);  // ranks on one machine share it; others make it
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(JOIN_TIMEOUT_MS);
    Comm* c = new Comm();
    c->rank = rank;
    c->size = nranks;
    c->fds.assign(nranks, -1);
    int listener = listen_at(socket_path(dir, rank));
    if (listener < 0) {
        delete c;
        return ncclSystemError;
    }
    bool ok = true;
    // Each rank connects to every lower one and says who it is; the higher
    // ones connect to it.
    for (int peer = 0; peer < rank && ok; peer++) {
        int fd = connect_to(socket_path(dir, peer), deadline);
        ok = fd >= 0 && write_all(fd, (const char*)&rank, sizeof(rank));
        if (fd >= 0) c->fds[peer] = fd;
    }
    for (int joined = rank + 1; joined < nranks && ok; joined++) {
        pollfd p{listener, POLLIN, 0};
        auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0 || poll(&p, 1, (int)left.count()) != 1) {
            ok = false;
            break;
        }
        int fd = accept(listener, nullptr, nullptr);
        int who = -1;
        ok = fd >= 0 && read_all(fd, (char*)&who, sizeof(who)) && who > rank &&
             who < nranks && c->fds[who] < 0;
        if (ok) {
            c->fds[who] = fd;
        } else if (fd >= 0) {
            close(fd);
        }
    }
    close(listener);
    unlink(socket_path(dir, rank).c_str());
    if (!ok) {
        for (int fd : c->fds)
            if (fd >= 0) close(fd);
        delete c;
        return ncclSystemError;
    }
    *out = c;
    return ncclSuccess;
}

static void shut(Comm* c) {
    for (int fd : c->fds)
        if (fd >= 0) shutdown(fd, SHUT_RDWR);
}

API ncclResult_t ncclCommAbort(ncclComm_t c) {
    if (c == nullptr) return ncclSuccess;
    c->aborted = true;
    shut(c);
    // Transfers still queued find the sockets shut and end; the
    // communicator itself is left allocated for them.
    return ncclSuccess;
}

API ncclResult_t ncclCommDestroy(ncclComm_t c) {
    if (c == nullptr) return ncclSuccess;
    shut(c);
    for (int fd : c->fds)
        if (fd >= 0) close(fd);
    delete c;
    return ncclSuccess;
}

API ncclResult_t ncclCommFinalize(ncclComm_t) { return ncclSuccess; }

API ncclResult_t ncclCommCount(const ncclComm_t c, int* count) {
    *count = c->size;
    return ncclSuccess;
}

API ncclResult_t ncclCommUserRank(const ncclComm_t c, int* rank) {
    *rank = c->rank;
    return ncclSuccess;
}

API ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t* error) {
    *error = (ncclResult_t)c->error.load();
    return ncclSuccess;
}

// A transfer's frame: its bytes (u64), then the bytes.
static void run_job(void* ctx) {
    Job* job = (Job*)ctx;
    Comm* c = job->comm;
    std::atomic<bool> send_failed{false};
    std::thread sender([&] {
        for (const Op& op : job->ops) {
            if (!op.send) continue;
            uint64_t n = op.bytes;
            if (!write_all(c->fds[op.peer], (const char*)&n, sizeof(n)) ||
                !write_all(c->fds[op.peer], op.ptr, op.bytes)) {
                send_failed = true;
                break;
            }
        }
    });
    int error = ncclSuccess;
    for (const Op& op : job->ops) {
        if (op.send) continue;
        uint64_t n = 0;
        if (!read_all(c->fds[op.peer], (char*)&n, sizeof(n))) {
            error = ncclRemoteError;
            break;
        }
        if (n != op.bytes) {
            fprintf(stderr, "fake NCCL: rank %d expected %zu bytes from %d, which sent %llu\n",
                    c->rank, op.bytes, op.peer, (unsigned long long)n);
            error = ncclInvalidUsage;
            shut(c);
            break;
        }
        if (!read_all(c->fds[op.peer], op.ptr, op.bytes)) {
            error = ncclRemoteError;
            break;
        }
    }
    if (error != ncclSuccess) shut(c);  // so the sender does not wait on a peer
    sender.join();
    if (error == ncclSuccess && send_failed) error = ncclRemoteError;
    if (error != ncclSuccess) {
        int none = ncclSuccess;
        c->error.compare_exchange_strong(none, error);
    }
    delete job;
}

static ncclResult_t queue(Comm* c, void* stream, std::vector<Op> ops) {
    if (ops.empty()) return ncclSuccess;
    if (c->aborted || c->error.load() != ncclSuccess) return ncclInvalidUsage;
    Job* job = new Job{c, std::move(ops)};
    strata_fake_cuda_enqueue(stream, run_job, job);
    return ncclSuccess;
}

static ncclResult_t add(bool send, const void* buf, size_t count, int type, int peer, Comm* c,
                        void* stream) {
    // Only bytes (ncclUint8 = 1, ncclInt8 = 0) are modeled.
    if (type != 0 && type != 1) return ncclInvalidArgument;
    if (c == nullptr || peer < 0 || peer >= c->size || peer == c->rank) return ncclInvalidArgument;
    Op op{send, (char*)buf, count, peer};
    if (group_depth == 0) return queue(c, stream, {op});
    if (pending_comm != nullptr && (pending_comm != c || pending_stream != stream))
        return ncclInvalidUsage;  // one communicator and stream a group, here
    pending_comm = c;
    pending_stream = stream;
    pending.push_back(op);
    return ncclSuccess;
}

API ncclResult_t ncclSend(const void* buf, size_t count, int type, int peer, ncclComm_t c,
                          void* stream) {
    return add(true, buf, count, type, peer, c, stream);
}

API ncclResult_t ncclRecv(void* buf, size_t count, int type, int peer, ncclComm_t c,
                          void* stream) {
    return add(false, buf, count, type, peer, c, stream);
}

API ncclResult_t ncclGroupStart() {
    group_depth += 1;
    return ncclSuccess;
}

API ncclResult_t ncclGroupEnd() {
    if (group_depth == 0) return ncclInvalidUsage;
    group_depth -= 1;
    if (group_depth > 0 || pending_comm == nullptr) return ncclSuccess;
    ncclResult_t r = queue(pending_comm, pending_stream, std::move(pending));
    pending.clear();
    pending_comm = nullptr;
    pending_stream = nullptr;
    return r;
}
