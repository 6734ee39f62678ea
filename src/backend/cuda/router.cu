// The router's kernels after its logits (math/router.rs, math/permute.rs):
// the scores and top-k choice, the permutation that groups a layer's
// assignments by expert, the sums its losses need, and the logits'
// gradient. Appended to kernels.cu (its helpers and rules hold here).

#define STRATA_NEG_INF __int_as_float(0xff800000)

// math::router_forward after the logits, one thread a token: softmax,
// top-k (ties to the lower index), combine weights (renormalized or not).
extern "C" __global__ void router_top_k(const float* logits, float* probs, float* lse_out,
                                        unsigned* experts, float* weights, unsigned t,
                                        unsigned e, unsigned k, unsigned renormalize) {
    unsigned i = strata_index();
    if (i >= t) return;
    const float* row = logits + (unsigned long long)i * e;
    float lse = strata_log_sum_exp(row, e);
    lse_out[i] = lse;
    float* p = probs + (unsigned long long)i * e;
    for (unsigned j = 0; j < e; ++j) p[j] = strata_exp(row[j] - lse);
    float total = 0.0f;
    for (unsigned s = 0; s < k; ++s) {
        int best = -1;
        for (unsigned j = 0; j < e; ++j) {
            bool taken = false;
            for (unsigned q = 0; q < s; ++q) taken |= experts[(unsigned long long)i * k + q] == j;
            if (taken) continue;
            if (best < 0 || p[j] > p[best]) best = (int)j;
        }
        experts[(unsigned long long)i * k + s] = (unsigned)best;
        weights[(unsigned long long)i * k + s] = p[best];
        total += p[best];
    }
    if (renormalize) {
        for (unsigned s = 0; s < k; ++s) weights[(unsigned long long)i * k + s] = weights[(unsigned long long)i * k + s] / total;
    }
}

// math::route_logits under Scoring::SigmoidGrouped, one thread a token:
// σ(logit) for each expert; the choice by score plus `bias` among the
// `kept` groups whose two best biased scores sum highest (ties to the
// lower index, as math::top_k); the chosen scores as weights, divided by
// their sum plus 1e-20 where `renormalize`, times `scale`.
// `group_scores` is (t, groups) scratch.
extern "C" __global__ void router_sigmoid_top_k(const float* logits, const float* bias,
                                                float* scores, float* group_scores,
                                                unsigned* experts, float* weights, unsigned t,
                                                unsigned e, unsigned k, unsigned groups,
                                                unsigned kept, unsigned renormalize,
                                                float scale) {
    unsigned i = strata_index();
    if (i >= t) return;
    const float* row = logits + (unsigned long long)i * e;
    float* p = scores + (unsigned long long)i * e;
    for (unsigned j = 0; j < e; ++j) p[j] = strata_sigmoid(row[j]);
    unsigned size = e / groups;
    float* gs = group_scores + (unsigned long long)i * groups;
    for (unsigned g = 0; g < groups; ++g) {
        unsigned first = g * size;
        int b0 = -1, b1 = -1;
        for (unsigned j = first; j < first + size; ++j)
            if (b0 < 0 || p[j] + bias[j] > p[b0] + bias[b0]) b0 = (int)j;
        for (unsigned j = first; j < first + size; ++j) {
            if ((int)j == b0) continue;
            if (b1 < 0 || p[j] + bias[j] > p[b1] + bias[b1]) b1 = (int)j;
        }
        gs[g] = (p[b0] + bias[b0]) + (p[b1] + bias[b1]);
    }
    // A kept group's score becomes -inf, which no group score is (each is
    // finite), so that the kept ones are known afterwards.
    for (unsigned s = 0; s < kept; ++s) {
        int best = -1;
        for (unsigned g = 0; g < groups; ++g) {
            if (gs[g] == STRATA_NEG_INF) continue;
            if (best < 0 || gs[g] > gs[best]) best = (int)g;
        }
        gs[best] = STRATA_NEG_INF;
    }
    unsigned* chosen = experts + (unsigned long long)i * k;
    for (unsigned s = 0; s < k; ++s) {
        int best = -1;
        float best_value = 0.0f;
        for (unsigned j = 0; j < e; ++j) {
            bool taken = false;
            for (unsigned q = 0; q < s; ++q) taken |= chosen[q] == j;
            if (taken) continue;
            float v = gs[j / size] == STRATA_NEG_INF ? p[j] + bias[j] : STRATA_NEG_INF;
            if (best < 0 || v > best_value) {
                best = (int)j;
                best_value = v;
            }
        }
        chosen[s] = (unsigned)best;
    }
    float total = 0.0f;
    for (unsigned s = 0; s < k; ++s) total += p[chosen[s]];
    total = total + 1e-20f;
    for (unsigned s = 0; s < k; ++s) {
        float w = p[chosen[s]];
        if (renormalize) w = w / total;
        weights[(unsigned long long)i * k + s] = w * scale;
    }
}

// math::Permutation::from_routing in three passes over chunks of `chunk`
// assignments (n = T·K), one thread a (chunk, expert) pair or an expert:
// a chunk's count of each expert; each expert's count; then each (chunk,
// expert) places its chunk's assignments to that expert, in assignment
// order, after every lower expert's and after the expert's in earlier
// chunks. Integer counts: the same permutation whatever the threads'
// order.
extern "C" __global__ void permutation_chunk_counts(const unsigned* experts,
                                                    unsigned* chunk_counts, unsigned n,
                                                    unsigned e, unsigned chunk) {
    unsigned idx = strata_index();
    unsigned chunks = (n + chunk - 1) / chunk;
    if (idx >= chunks * e) return;
    unsigned c = idx / e, x = idx % e;
    unsigned end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
    unsigned count = 0;
    for (unsigned a = c * chunk; a < end; ++a) count += experts[a] == x ? 1u : 0u;
    chunk_counts[idx] = count;
}

extern "C" __global__ void permutation_counts(const unsigned* chunk_counts, unsigned* counts,
                                              unsigned n, unsigned e, unsigned chunk) {
    unsigned x = strata_index();
    if (x >= e) return;
    unsigned chunks = (n + chunk - 1) / chunk;
    unsigned count = 0;
    for (unsigned c = 0; c < chunks; ++c) count += chunk_counts[c * e + x];
    counts[x] = count;
}

extern "C" __global__ void permutation_place(const unsigned* experts,
                                             const unsigned* chunk_counts,
                                             const unsigned* counts, unsigned* order,
                                             unsigned* position, unsigned n, unsigned e,
                                             unsigned chunk) {
    unsigned idx = strata_index();
    unsigned chunks = (n + chunk - 1) / chunk;
    if (idx >= chunks * e) return;
    unsigned c = idx / e, x = idx % e;
    unsigned cursor = 0;
    for (unsigned y = 0; y < x; ++y) cursor += counts[y];
    for (unsigned d = 0; d < c; ++d) cursor += chunk_counts[d * e + x];
    unsigned end = (c + 1) * chunk < n ? (c + 1) * chunk : n;
    for (unsigned a = c * chunk; a < end; ++a) {
        if (experts[a] != x) continue;
        order[cursor] = a;
        position[a] = cursor;
        ++cursor;
    }
}

// math::aux_prob_grad from a layer's own counts, one thread an expert:
// aux[j] = daux · E · f_j / T with f_j = counts[j] / (T·K) divided in f64
// and rounded, multiplied and divided in that order.
extern "C" __global__ void aux_prob_grad(const unsigned* counts, float* aux, float daux,
                                         unsigned t, unsigned k, unsigned e) {
    unsigned j = strata_index();
    if (j >= e) return;
    float frac = (float)((double)counts[j] / (double)((unsigned long long)t * k));
    aux[j] = daux * (float)(double)e * frac / (float)(double)t;
}

// A serial sum's next STRATA_LOADS_AHEAD values are loaded at once and then
// added in order: the same sum, with that many loads in flight, not one.
#define STRATA_LOADS_AHEAD 16u

// What a layer's losses read (math::route_logits), one thread an expert
// and one more: sums[j] = Σ_t probs[t, j] in token order (j < e), and
// sums[e] = Σ_t lse[t]², the z-loss's sum.
extern "C" __global__ void router_sums(const float* probs, const float* lse, float* sums,
                                       unsigned t, unsigned e) {
    unsigned j = strata_index();
    if (j > e) return;
    bool square = j == e;
    const float* x = square ? lse : probs + j;
    unsigned long long stride = square ? 1u : e;
    float sum = 0.0f;
    unsigned i = 0;
    for (; i + STRATA_LOADS_AHEAD <= t; i += STRATA_LOADS_AHEAD) {
        float v[STRATA_LOADS_AHEAD];
#pragma unroll
        for (unsigned u = 0; u < STRATA_LOADS_AHEAD; ++u) v[u] = x[(i + u) * stride];
#pragma unroll
        for (unsigned u = 0; u < STRATA_LOADS_AHEAD; ++u) sum += square ? v[u] * v[u] : v[u];
    }
    for (; i < t; ++i) {
        float v = x[i * stride];
        sum += square ? v * v : v;
    }
    sums[j] = sum;
}

// A layer's losses from its counts and router_sums' sums, one thread, in
// math::balance_loss's order: losses[0] = E · Σ_j f_j · (sums[j] / T),
// f_j = counts[j] / (T·K) divided in f64 and rounded, and losses[1] =
// sums[E] / T, the z-loss.
extern "C" __global__ void router_losses(const unsigned* counts, const float* sums,
                                         float* losses, unsigned t, unsigned k, unsigned e) {
    if (strata_index() != 0) return;
    float tf = (float)(double)t;
    float aux = 0.0f;
    for (unsigned j = 0; j < e; ++j) {
        float frac = (float)((double)counts[j] / (double)((unsigned long long)t * k));
        aux += frac * (sums[j] / tf);
    }
    losses[0] = (float)(double)e * aux;
    losses[1] = sums[e] / tf;
}

// sums[j] += Σ_t probs[t, j] in f64, in token order, one thread an expert
// (the load-balancing loss over every layer, lm::network's all_layers_aux).
extern "C" __global__ void add_prob_sums(const float* probs, double* sums, unsigned t,
                                         unsigned e) {
    unsigned j = strata_index();
    if (j >= e) return;
    double sum = sums[j];
    unsigned i = 0;
    for (; i + STRATA_LOADS_AHEAD <= t; i += STRATA_LOADS_AHEAD) {
        float v[STRATA_LOADS_AHEAD];
#pragma unroll
        for (unsigned u = 0; u < STRATA_LOADS_AHEAD; ++u)
            v[u] = probs[(unsigned long long)(i + u) * e + j];
#pragma unroll
        for (unsigned u = 0; u < STRATA_LOADS_AHEAD; ++u) sum += (double)v[u];
    }
    for (; i < t; ++i) sum += (double)probs[(unsigned long long)i * e + j];
    sums[j] = sum;
}

// math::router_logits_grad, one thread a token: the probabilities'
// gradient from the combine weights' (dweights) and the load-balancing
// loss's (`aux`, the same for every token: math::aux_prob_grad), then the
// logits' through the softmax (with the z-loss's, dz2 = 2·dz) or the
// sigmoid. dlogits' row holds the probabilities' gradient meanwhile.
extern "C" __global__ void router_logits_grad(const float* probs, const float* lse,
                                              const unsigned* experts, const float* weights,
                                              const float* dweights, const float* aux,
                                              float* dlogits, unsigned t, unsigned e,
                                              unsigned k, unsigned renormalize,
                                              unsigned sigmoid, float scale, float dz2) {
    unsigned i = strata_index();
    if (i >= t) return;
    const float* p = probs + (unsigned long long)i * e;
    const unsigned* chosen = experts + (unsigned long long)i * k;
    const float* w = weights + (unsigned long long)i * k;
    const float* dw = dweights + (unsigned long long)i * k;
    float* dp = dlogits + (unsigned long long)i * e;
    for (unsigned j = 0; j < e; ++j) dp[j] = 0.0f;
    if (renormalize) {
        float total = sigmoid ? 1e-20f : 0.0f;
        float dot = 0.0f;
        for (unsigned s = 0; s < k; ++s) {
            total += p[chosen[s]];
            dot += dw[s] * w[s];
        }
        for (unsigned s = 0; s < k; ++s)
            dp[chosen[s]] += sigmoid ? scale * (dw[s] - dot / scale) / total
                                     : (dw[s] - dot) / total;
    } else {
        for (unsigned s = 0; s < k; ++s) dp[chosen[s]] += sigmoid ? scale * dw[s] : dw[s];
    }
    for (unsigned j = 0; j < e; ++j) dp[j] += aux[j];
    if (sigmoid) {
        for (unsigned j = 0; j < e; ++j) dp[j] = dp[j] * p[j] * (1.0f - p[j]);
        return;
    }
    float dot = 0.0f;
    for (unsigned j = 0; j < e; ++j) dot += p[j] * dp[j];
    float zscale = dz2 * lse[i] / (float)t;
    for (unsigned j = 0; j < e; ++j) dp[j] = p[j] * (dp[j] - dot) + zscale * p[j];
}
