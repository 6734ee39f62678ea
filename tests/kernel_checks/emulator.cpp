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

STRATA_LAUNCHER(swiglu_forward)
STRATA_LAUNCHER(swiglu_backward)
STRATA_LAUNCHER(gelu_forward)
STRATA_LAUNCHER(gelu_backward)
STRATA_LAUNCHER(f32_to_bf16)
STRATA_LAUNCHER(adamw)
STRATA_LAUNCHER(rmsnorm_forward)
STRATA_LAUNCHER(rmsnorm_backward_dx)
STRATA_LAUNCHER(column_partials)
STRATA_LAUNCHER(add_column_partials)
STRATA_LAUNCHER(rope)
STRATA_LAUNCHER(cross_entropy)
STRATA_LAUNCHER(router_top_k)
STRATA_LAUNCHER(gather_rows)
STRATA_LAUNCHER(scatter_rows)
STRATA_LAUNCHER(attn_to_heads)
STRATA_LAUNCHER(attn_from_heads)
STRATA_LAUNCHER(attn_softmax)
STRATA_LAUNCHER(attn_softmax_backward)
STRATA_LAUNCHER(add_into)
STRATA_LAUNCHER(add_bias)
STRATA_LAUNCHER(clamp_values)
STRATA_LAUNCHER(clamp_grad)
STRATA_LAUNCHER(combine_rows)
STRATA_LAUNCHER(combine_weights_grad)
STRATA_LAUNCHER(weighted_rows)
STRATA_LAUNCHER(gather_rows_backward)
STRATA_LAUNCHER(embedding_backward)
STRATA_LAUNCHER(square_sums)
STRATA_LAUNCHER(sigmoid_values)
STRATA_LAUNCHER(add_scaled_rows)
STRATA_LAUNCHER(gate_backward)

// The launcher of kernel `name` (what cuModuleGetFunction finds), or null.
typedef void (*strata_launcher)(unsigned, unsigned, void**);
extern "C" strata_launcher strata_emulated_kernel(const char* name) {
    static const struct {
        const char* name;
        strata_launcher launch;
    } table[] = {
#define STRATA_ENTRY(n) {#n, strata_launch_##n},
        STRATA_ENTRY(swiglu_forward) STRATA_ENTRY(swiglu_backward) STRATA_ENTRY(gelu_forward)
        STRATA_ENTRY(gelu_backward) STRATA_ENTRY(f32_to_bf16) STRATA_ENTRY(adamw)
        STRATA_ENTRY(rmsnorm_forward) STRATA_ENTRY(rmsnorm_backward_dx)
        STRATA_ENTRY(column_partials) STRATA_ENTRY(add_column_partials)
        STRATA_ENTRY(rope) STRATA_ENTRY(cross_entropy)
        STRATA_ENTRY(router_top_k) STRATA_ENTRY(gather_rows) STRATA_ENTRY(scatter_rows)
        STRATA_ENTRY(attn_to_heads) STRATA_ENTRY(attn_from_heads) STRATA_ENTRY(attn_softmax)
        STRATA_ENTRY(attn_softmax_backward) STRATA_ENTRY(add_into) STRATA_ENTRY(add_bias)
        STRATA_ENTRY(clamp_values) STRATA_ENTRY(clamp_grad)
        STRATA_ENTRY(combine_rows) STRATA_ENTRY(combine_weights_grad) STRATA_ENTRY(weighted_rows)
        STRATA_ENTRY(gather_rows_backward) STRATA_ENTRY(embedding_backward)
        STRATA_ENTRY(square_sums) STRATA_ENTRY(sigmoid_values) STRATA_ENTRY(add_scaled_rows)
        STRATA_ENTRY(gate_backward)
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
        STRATA_ENTRY(swiglu_forward) STRATA_ENTRY(swiglu_backward) STRATA_ENTRY(gelu_forward)
        STRATA_ENTRY(gelu_backward) STRATA_ENTRY(f32_to_bf16) STRATA_ENTRY(adamw)
        STRATA_ENTRY(rmsnorm_forward) STRATA_ENTRY(rmsnorm_backward_dx)
        STRATA_ENTRY(column_partials) STRATA_ENTRY(add_column_partials)
        STRATA_ENTRY(rope) STRATA_ENTRY(cross_entropy)
        STRATA_ENTRY(router_top_k) STRATA_ENTRY(gather_rows) STRATA_ENTRY(scatter_rows)
        STRATA_ENTRY(attn_to_heads) STRATA_ENTRY(attn_from_heads) STRATA_ENTRY(attn_softmax)
        STRATA_ENTRY(attn_softmax_backward) STRATA_ENTRY(add_into) STRATA_ENTRY(add_bias)
        STRATA_ENTRY(clamp_values) STRATA_ENTRY(clamp_grad)
        STRATA_ENTRY(combine_rows) STRATA_ENTRY(combine_weights_grad) STRATA_ENTRY(weighted_rows)
        STRATA_ENTRY(gather_rows_backward) STRATA_ENTRY(embedding_backward)
        STRATA_ENTRY(square_sums) STRATA_ENTRY(sigmoid_values) STRATA_ENTRY(add_scaled_rows)
        STRATA_ENTRY(gate_backward)
#undef STRATA_ENTRY
    };
    for (const auto& entry : table) {
        if (strcmp(entry.name, name) == 0) return entry.bind;
    }
    return nullptr;
}
