// kernels.cu compiled as plain C++ for the CPU: each launch runs every
// (block, thread) of its grid in turn. Sound for these kernels because none
// uses shared memory, barriers, warp functions or atomics: each thread's
// work is independent of the others'. Arguments arrive as cuLaunchKernel
// takes them: an array of pointers to each argument's value.
#include <math.h>
#include <string.h>
#include <cstddef>
#include <functional>
#include <tuple>
#include <utility>

struct strata_dim3 {
    unsigned x;
};
// Thread-local: test threads may launch concurrently.
static thread_local strata_dim3 blockIdx, blockDim, threadIdx;

#define __global__
#define __device__
#define __forceinline__ inline

static inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, sizeof u);
    return u;
}
static inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, sizeof f);
    return f;
}

#include "kernels.cu"
#include "router.cu"

template <typename... A, std::size_t... I>
static void call(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<A*>(args[I])...);
}

template <typename... A, std::size_t... I>
static std::tuple<A...> bind_values(void** args, std::index_sequence<I...>) {
    return std::tuple<A...>(*static_cast<A*>(args[I])...);
}

template <typename... A, std::size_t... I>
static void fill_pointers(std::tuple<A...>& values, void** ptrs, std::index_sequence<I...>) {
    ((ptrs[I] = &std::get<I>(values)), ...);
}

template <typename... A>
static void launch(void (*kernel)(A...), unsigned grid, unsigned block, void** args) {
    blockDim.x = block;
    for (unsigned b = 0; b < grid; ++b) {
        blockIdx.x = b;
        for (unsigned t = 0; t < block; ++t) {
            threadIdx.x = t;
            call(kernel, args, std::index_sequence_for<A...>{});
        }
    }
}

// A launch to run later (the CPU model of a CUDA stream): the arguments'
// values are copied now, as cuLaunchKernel copies them.
template <typename... A>
static std::function<void()> bind(void (*kernel)(A...), unsigned grid, unsigned block,
                                  void** args) {
    std::tuple<A...> values = bind_values<A...>(args, std::index_sequence_for<A...>{});
    return [kernel, grid, block, values]() mutable {
        void* ptrs[sizeof...(A) + 1];
        fill_pointers(values, ptrs, std::index_sequence_for<A...>{});
        launch(kernel, grid, block, ptrs);
    };
}

#define STRATA_LAUNCHER(name)                                                       \
    extern "C" void strata_launch_##name(unsigned grid, unsigned block, void** args) { \
        launch(name, grid, block, args);                                            \
    }                                                                               \
    [[maybe_unused]] static std::function<void()> strata_bind_##name(unsigned grid, unsigned block, \
                                                    void** args) {                  \
        return bind(name, grid, block, args);                                       \
    }

// Every kernel of kernels.cu and router.cu, once: a new kernel is added
// here and nowhere else in this file.
#define STRATA_KERNELS(X)                                                           \
    X(swiglu_forward) X(swiglu_backward) X(gelu_forward) X(gelu_backward)           \
    X(f32_to_bf16) X(adamw) X(row_partials) X(rmsnorm_forward)                      \
    X(rmsnorm_backward_dx) X(column_partials) X(add_column_partials) X(rope)        \
    X(logit_partials) X(cross_entropy_loss) X(cross_entropy) X(gather_rows)         \
    X(scatter_rows) X(attn_to_heads) X(attn_from_heads) X(attn_softmax_partials)    \
    X(attn_softmax_stats) X(attn_softmax) X(attn_softmax_backward_partials)         \
    X(attn_softmax_backward) X(add_into) X(add_bias) X(clamp_values) X(clamp_grad)  \
    X(combine_rows) X(combine_weights_partials) X(combine_weights_grad)             \
    X(weighted_rows) X(gather_rows_backward) X(split_token_rows)                    \
    X(document_starts) X(token_order_runs) X(token_order_merge)                     \
    X(embedding_backward) X(sum_in_order) X(square_sums) X(sigmoid_values)          \
    X(add_scaled_rows) X(gate_backward) X(router_top_k) X(router_sigmoid_top_k)     \
    X(permutation_chunk_counts) X(permutation_counts) X(permutation_place)          \
    X(router_sums) X(router_losses) X(aux_prob_grad) X(add_prob_sums)               \
    X(router_logits_grad) X(group_words)

STRATA_KERNELS(STRATA_LAUNCHER)

// The launcher of kernel `name` (what cuModuleGetFunction finds), or null.
typedef void (*strata_launcher)(unsigned, unsigned, void**);
extern "C" strata_launcher strata_emulated_kernel(const char* name) {
    static const struct {
        const char* name;
        strata_launcher launch;
    } table[] = {
#define STRATA_ENTRY(n) {#n, strata_launch_##n},
        STRATA_KERNELS(STRATA_ENTRY)
#undef STRATA_ENTRY
    };
    for (const auto& entry : table) {
        if (strcmp(entry.name, name) == 0) return entry.launch;
    }
    return nullptr;
}

// The binder of kernel `name`, for launches that run later, or null.
typedef std::function<void()> (*strata_binder)(unsigned, unsigned, void**);
[[maybe_unused]] static strata_binder strata_emulated_binder(const char* name) {
    static const struct {
        const char* name;
        strata_binder bind;
    } table[] = {
#define STRATA_ENTRY(n) {#n, strata_bind_##n},
        STRATA_KERNELS(STRATA_ENTRY)
#undef STRATA_ENTRY
    };
    for (const auto& entry : table) {
        if (strcmp(entry.name, name) == 0) return entry.bind;
    }
    return nullptr;
}
