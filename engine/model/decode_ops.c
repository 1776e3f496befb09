/* One Kimi Delta Attention token per call site, whole: short conv, l2 norms, gate, delta rule, output.
 *
 * Why: in a float32 decode step on one CPU thread the recurrence of one KDA layer is about forty small
 * torch operators (conv window, SiLU, two l2 norms, the gate's sigmoid, the state's decay, S^T k, the
 * rank-one update, S^T q), each a dispatch of a few microseconds over a few kilobytes; here it is one
 * pass per head over a state that stays in L1 (engine/model/decode_ops.py).
 *
 * The arithmetic is the recurrence of engine/model/kda_ops.py, token by token, in float32:
 *   y = silu(sum_w state_w * conv_w + x * conv_last);  q, k = l2norm(q), l2norm(k);  q *= scale
 *   g = lower * sigmoid(a_h * (raw + dt_bias))  (or the given log-decay);  beta = sigmoid(b)
 *   S = exp(g) S;  S += beta k (v - S^T k)^T;  o = S^T q
 * It differs from the torch form in rounding only (sums in another order), and every token of every
 * caller (plain decoding, speculative verification) runs this same code, so a token's result does not
 * depend on the path that ran it.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define HOT __attribute__((target("avx2,fma")))

/* exp(x) in float32, branch-free so that loops over it vectorise (libm's expf is a call per element):
 * x = n ln2 + r with |r| <= ln2/2, exp(r) by Cephes' degree-6 polynomial (about 1 ulp, as torch's
 * vectorised exp), times 2^n built in the exponent bits as two halves (so results down in float32's
 * subnormal range come out right); x clamped to [-104, 88.5], where float32 is 0 and about its largest.
 * Vectorising needs -fno-trapping-math (engine/model/rowdot.py's CFLAGS). */
HOT static inline float exp_poly(float x) {
    x = x < -104.0f ? -104.0f : (x > 88.5f ? 88.5f : x);
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = fmaf(n, -0.693359375f, x);
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p * r, r, r) + 1.0f;
    const int32_t half = (int32_t)n >> 1, bits_a = (half + 127) << 23, bits_b = ((int32_t)n - half + 127) << 23;
    float scale_a, scale_b;
    memcpy(&scale_a, &bits_a, sizeof scale_a);
    memcpy(&scale_b, &bits_b, sizeof scale_b);
    return p * scale_a * scale_b;
}

/* tanh(x): Cephes' odd polynomial below |x| = 0.625 (no cancellation near 0), 1 - 2 / (exp(2|x|) + 1)
 * above, with x's sign. */
HOT static inline float tanh_poly(float x) {
    const float a = fabsf(x), z = x * x;
    float small = -5.70498872745e-3f;
    small = fmaf(small, z, 2.06390887954e-2f);
    small = fmaf(small, z, -5.37397155531e-2f);
    small = fmaf(small, z, 1.33314422036e-1f);
    small = fmaf(small, z, -3.33332819422e-1f);
    small = fmaf(small * z, x, x);
    const float big = copysignf(1.0f - 2.0f / (exp_poly(2.0f * a) + 1.0f), x);
    return a < 0.625f ? small : big;
}

/* 1 / (1 + exp(-z)), with exp(-|z|) only (never overflows): e^z / (1 + e^z) for z < 0. */
HOT static inline float sigmoidf(float z) {
    const float e = exp_poly(-fabsf(z)), s = 1.0f / (1.0f + e);
    return z >= 0.0f ? s : e * s;
}

/* sum a[i] * b[i] in 16 lanes (a float sum in one chain would not vectorise: C keeps its order) */
HOT static inline float dot(const float *a, const float *b, long n) {
    float lane[16] = {0};
    long i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++)
            lane[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (int l = 0; l < 16; l++)
        s += lane[l];
    for (; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* The conv of one token over channels [0, C): y = silu(window . kernel), then the window moves on.
 * state [W-1][C] (oldest first), kernel_t [W][C] (the conv kernels transposed), x [C]. */
HOT static void conv_token(float *state, const float *kernel_t, const float *x, float *y, long C, long W) {
    for (long c = 0; c < C; c++)
        y[c] = 0.0f;
    for (long w = 0; w < W - 1; w++)
        for (long c = 0; c < C; c++)
            y[c] += state[w * C + c] * kernel_t[w * C + c];
    for (long c = 0; c < C; c++) {
        const float s = y[c] + x[c] * kernel_t[(W - 1) * C + c];
        y[c] = s / (1.0f + exp_poly(-s));
    }
    if (W > 1) {
        memmove(state, state + C, (size_t)(W - 2) * C * sizeof(float));
        memcpy(state + (W - 2) * C, x, (size_t)C * sizeof(float));
    }
}

/* `dot` accumulated in double: for the depth-softmax logits of AttnRes, whose float rounding moved a W4A8
 * model's activations across int8 steps between prefill and decode (test_w4a8_checkpoint_loads_...). */
HOT static inline double dot_double(const float *a, const float *b, long n) {
    double lane[8] = {0};
    long i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++)
            lane[l] += (double)a[i + l] * (double)b[i + l];
    double s = 0.0;
    for (int l = 0; l < 8; l++)
        s += lane[l];
    for (; i < n; i++)
        s += (double)a[i] * (double)b[i];
    return s;
}

HOT static void l2norm(float *x, long n, float times) {
    const float r = times / sqrtf(dot(x, x, n) + 1e-6f);
    for (long i = 0; i < n; i++)
        x[i] *= r;
}

/* One head's delta rule on S [K][V] in place; q already scaled; o [V] out. */
HOT static void delta_rule(float *S, const float *q, const float *k, const float *v, const float *decay,
                           float beta, float *o, float *mem, long K, long V) {
    for (long j = 0; j < V; j++)
        mem[j] = 0.0f;
    for (long i = 0; i < K; i++) {
        float *row = S + i * V;
        const float d = decay[i], ki = k[i];
        for (long j = 0; j < V; j++) {
            row[j] *= d;
            mem[j] += ki * row[j];
        }
    }
    for (long j = 0; j < V; j++) {
        mem[j] = beta * (v[j] - mem[j]);          /* delta */
        o[j] = 0.0f;
    }
    for (long i = 0; i < K; i++) {
        float *row = S + i * V;
        const float ki = k[i], qi = q[i];
        for (long j = 0; j < V; j++) {
            row[j] += ki * mem[j];
            o[j] += qi * row[j];
        }
    }
}

/* B sequences of T tokens each (T > 1: speculative verification). Row r = b * T + t of qkv [rows][qkv_step]
 * holds the pre-conv q|k|v ([3][H][K]); raw [rows][H*K] the gate logits (or, with a_h == NULL, the
 * log-decay itself); b_raw [rows][H] the beta logits. conv_store [slots][W-1][3HK] and rec_store
 * [slots][H][K][V] are the cache, updated in place at slots[b]; after token t < T-1 the state is also
 * copied to spec[b * (T-1) + t] (when spec is not NULL). out [rows][H][V]. */
HOT void kda_decode(long B, long T, long H, long K, long V, long W,
                    const float *qkv, long qkv_step, const float *kernel_t,
                    const float *raw, const float *a_h, const float *dt_bias, float lower,
                    const float *b_raw, float *conv_store, float *rec_store,
                    const long *slots, const long *spec, float scale, float *out) {
    const long C = 2 * H * K + H * V, state_size = H * K * V, conv_size = (W - 1) * C;
    for (long b = 0; b < B; b++) {
        float *conv = conv_store + slots[b] * conv_size;
        float *rec = rec_store + slots[b] * state_size;
        for (long t = 0; t < T; t++) {
            const long r = b * T + t;
            float mixed[C];
            conv_token(conv, kernel_t, qkv + r * qkv_step, mixed, C, W);
            for (long h = 0; h < H; h++) {
                float *q = mixed + h * K, *k = mixed + H * K + h * K, *v = mixed + 2 * H * K + h * V;
                float decay[K], mem[V];
                l2norm(q, K, scale);
                l2norm(k, K, 1.0f);
                const float *gr = raw + r * H * K + h * K;
                if (a_h)
                    for (long i = 0; i < K; i++)
                        decay[i] = exp_poly(lower * sigmoidf(a_h[h] * (gr[i] + dt_bias[h * K + i])));
                else
                    for (long i = 0; i < K; i++)
                        decay[i] = exp_poly(gr[i]);
                delta_rule(rec + h * K * V, q, k, v, decay, sigmoidf(b_raw[r * H + h]), out + r * H * V + h * V,
                           mem, K, V);
            }
            if (spec && t < T - 1) {
                const long s = spec[b * (T - 1) + t];
                memcpy(conv_store + s * conv_size, conv, (size_t)conv_size * sizeof(float));
                memcpy(rec_store + s * state_size, rec, (size_t)state_size * sizeof(float));
            }
        }
    }
}

/* Block Attention Residuals for rows [T] of n sources (pointers to [T][D] float32 each, row stride D):
 * per row, the softmax over sources of rms_normalised(source) . query, then the weighted sum of the
 * un-normalised sources (engine/model/attnres.py, whose torch form it equals to rounding). */
HOT void attn_res_rows(long n, const float *const *sources, long T, long D, const float *query, float eps,
                       float *out) {
    float logit[n];
    for (long t = 0; t < T; t++) {
        float top = -INFINITY;
        for (long i = 0; i < n; i++) {
            const float *v = sources[i] + t * D;
            logit[i] = (float)(dot_double(v, query, D) / sqrt(dot_double(v, v, D) / (double)D + eps));
            top = logit[i] > top ? logit[i] : top;
        }
        float total = 0.0f;
        for (long i = 0; i < n; i++) {
            logit[i] = expf(logit[i] - top);
            total += logit[i];
        }
        float *y = out + t * D;
        for (long d = 0; d < D; d++)
            y[d] = 0.0f;
        for (long i = 0; i < n; i++) {
            const float p = logit[i] / total, *v = sources[i] + t * D;
            for (long d = 0; d < D; d++)
                y[d] += p * v[d];
        }
    }
}

/* The MoE router's choice for rows [T] of logits (row stride `step`): sigmoid scores, the top_k of
 * score + bias (ties to the lower expert), weights the unbiased scores of those, renormalised to sum 1
 * when asked (k > 1), times `scaling` (engine/model/moe.py's `route`, equal to rounding). */
void moe_route(long T, long E, const float *logits, long step, const float *bias, long top_k, int renormalize,
               float scaling, float *weights, long *ids) {
    float score[E], biased[E];
    for (long t = 0; t < T; t++) {
        for (long e = 0; e < E; e++) {
            score[e] = sigmoidf(logits[t * step + e]);
            biased[e] = score[e] + bias[e];
        }
        float total = 0.0f;
        for (long j = 0; j < top_k; j++) {
            long best = -1;
            for (long e = 0; e < E; e++)
                if (biased[e] != -INFINITY && (best < 0 || biased[e] > biased[best]))
                    best = e;
            biased[best] = -INFINITY;
            ids[t * top_k + j] = best;
            weights[t * top_k + j] = score[best];
            total += score[best];
        }
        for (long j = 0; j < top_k; j++) {
            float w = weights[t * top_k + j];
            if (renormalize && top_k > 1)
                w = w / (total + 1e-20f);
            weights[t * top_k + j] = scaling == 1.0f ? w : w * scaling;
        }
    }
}

/* RMSNorm of rows [T] of x (row stride `step`, D floats each): y = x * rsqrt(mean(x^2) + eps) (* w),
 * the torch form (engine/model/layers.py's `rms_norm`) to rounding. w may be NULL. */
HOT void rms_norm_rows(long T, long D, const float *x, long step, const float *w, float eps, float *y) {
    for (long t = 0; t < T; t++) {
        const float *row = x + t * step;
        float *out = y + t * D;
        const float r = 1.0f / sqrtf(dot(row, row, D) / (float)D + eps);
        if (w)
            for (long d = 0; d < D; d++)
                out[d] = row[d] * r * w[d];
        else
            for (long d = 0; d < D; d++)
                out[d] = row[d] * r;
    }
}

/* Absorbed MLA attention (engine/model/mla.py) of R query rows, each one token over its own context:
 * row r reads the cached latents pages[index[starts[r] + l]] for l < lens[r] ([lora | rope] each, no gather
 * copy). Per head h: ql = q_nope W_UK[h]; p = softmax(scale (ql . c + q_pe . k_pe)); o = (p C) W_UV[h]^T.
 * The absorbed weights are read once for all rows (heads outer), each row's context once for all heads
 * (positions outer). scratch: 2 R H lora + H longest floats. The torch form to rounding. */
HOT void mla_attend(long R, long H, long nope, long rope, long lora, long vdim, const float *q, const float *pages,
                    const long *index, const long *starts, const long *lens, const float *w_uk, const float *w_uv,
                    float scale, float *scratch, float *out) {
    const long width = lora + rope, qdim = nope + rope;
    float *ql = scratch, *lat = scratch + R * H * lora, *probs = lat + R * H * lora;
    for (long h = 0; h < H; h++) {                       /* ql[r][h] = q_nope[r][h] W_UK[h] */
        const float *uk = w_uk + h * nope * lora;
        for (long r = 0; r < R; r++) {
            const float *qn = q + (r * H + h) * qdim;
            float *acc = ql + (r * H + h) * lora;
            for (long c = 0; c < lora; c++)
                acc[c] = 0.0f;
            for (long i = 0; i < nope; i++) {
                const float a = qn[i], *u = uk + i * lora;
                for (long c = 0; c < lora; c++)
                    acc[c] += a * u[c];
            }
        }
    }
    for (long r = 0; r < R; r++) {
        const long *rows = index + starts[r], n = lens[r];
        const float *qr = ql + r * H * lora;
        float *lr = lat + r * H * lora;
        for (long l = 0; l < n; l++) {                   /* scores, every head on one cached row */
            const float *row = pages + rows[l] * width;
            for (long h = 0; h < H; h++)
                probs[h * n + l] = (dot(qr + h * lora, row, lora) + dot(q + (r * H + h) * qdim + nope, row + lora, rope))
                                   * scale;
        }
        for (long h = 0; h < H; h++) {                   /* softmax per head */
            float *p = probs + h * n, top = -INFINITY, total = 0.0f;
            for (long l = 0; l < n; l++)
                top = p[l] > top ? p[l] : top;
            for (long l = 0; l < n; l++)
                p[l] = exp_poly(p[l] - top);
            for (long l = 0; l < n; l++)
                total += p[l];
            const float inv = 1.0f / total;
            for (long l = 0; l < n; l++)
                p[l] *= inv;
        }
        for (long i = 0; i < H * lora; i++)
            lr[i] = 0.0f;
        for (long l = 0; l < n; l++) {                   /* lat[h] = sum_l p[h][l] c_l, each row read once */
            const float *row = pages + rows[l] * width;
            for (long h = 0; h < H; h++) {
                const float p = probs[h * n + l];
                float *acc = lr + h * lora;
                for (long c = 0; c < lora; c++)
                    acc[c] += p * row[c];
            }
        }
    }
    for (long h = 0; h < H; h++) {                       /* o[r][h] = W_UV[h] lat[r][h] */
        const float *uv = w_uv + h * vdim * lora;
        for (long r = 0; r < R; r++) {
            const float *lr = lat + (r * H + h) * lora;
            float *o = out + (r * H + h) * vdim;
            for (long v = 0; v < vdim; v++)
                o[v] = dot(lr, uv + v * lora, lora);
        }
    }
}

/* SiTU-GLU (engine/model/layers.py's `situ`) of rows [T] of gate and up (row strides given), n columns:
 * beta tanh(g / beta) sigmoid(g) * (linear_beta tanh(u / linear_beta), or u when linear_beta <= 0). */
HOT void situ_rows(long T, long n, const float *gate, long gate_step, const float *up, long up_step, float beta,
                   float linear_beta, float *out) {
    const float inv_beta = 1.0f / beta, inv_lb = linear_beta > 0.0f ? 1.0f / linear_beta : 0.0f;
    for (long t = 0; t < T; t++) {
        const float *g = gate + t * gate_step, *u = up + t * up_step;
        float *y = out + t * n;
        if (linear_beta > 0.0f)
            for (long i = 0; i < n; i++)
                y[i] = beta * tanh_poly(g[i] * inv_beta) * sigmoidf(g[i]) * (linear_beta * tanh_poly(u[i] * inv_lb));
        else
            for (long i = 0; i < n; i++)
                y[i] = beta * tanh_poly(g[i] * inv_beta) * sigmoidf(g[i]) * u[i];
    }
}

/* rowdot.c's products, built into this library too (engine/model/decode_ops.py) */
void rowdot(const float *weight, const float *x, const float *bias, float *y, long out, long n, long rows);
void paneldot(const float *packed, const float *x, const float *bias, float *y, long out, long n, long rows);

/* `gemm.linear`'s choice for `rows` rows of a large weight on one thread: the row-major kernel up to
 * `row_major` rows, the panels (its packed copy) above */
static void product(const float *w, const float *panels, const float *x, float *y, long out, long n, long rows,
                    long row_major) {
    if (rows <= row_major)
        rowdot(w, x, 0, y, out, n, rows);
    else
        paneldot(panels, x, 0, y, out, n, rows);
}

/* R tokens through a latent MoE layer (engine/model/moe.py) whose linears `gemm.linear` would run on the
 * rowdot kernels (a decode step of up to sixteen rows on one thread): one call instead of some thirty
 * from Python. The same products and operators in the same order as the Python path (`LatentMoE.forward`
 * with fused float linears and the sorted dispatch), so bitwise its result:
 *   t = W_in x = [router logits E | latent h L | shared gate S | shared up S];  (weights, ids) = route(logits)
 *   the (token, slot) pairs sorted by expert (stable); per expert, its rows: a = situ(W13 h);  o = W2 a
 *   r[token] += o * weight, pair by pair in that order, from zero (index_put_'s accumulation)
 *   y = W_up rms_norm(r) + W_down situ(shared gate, shared up)
 * Each product of `rows` rows takes the row-major kernel up to `row_major` rows, else the weight's panel
 * copy (`*_panels`; for experts one pointer each, 0 where none was made yet). Returns 0, or the number of
 * experts listed in `missing` whose panel copies are needed first (nothing is written then but scratch).
 * norm_w NULL: no latent norm; S 0: no shared experts. scratch: R (E + L + 2S) + R k (3I + 2L + 1) + 2 R L
 * + R S + R d floats; iscratch: 2 R k + E longs. */
HOT long moe_rows(long R, long d, long E, long L, long S, long I, long top_k, long row_major, const float *x,
                  const float *w_in, const float *w_in_panels, const float *bias, int renormalize, float scaling,
                  const long *w13, const long *w2, const long *w13_panels, const long *w2_panels,
                  const float *norm_w, float eps, const float *w_up, const float *w_up_panels, const float *w_down,
                  const float *w_down_panels, float beta, float linear_beta, float *scratch, long *iscratch,
                  long *missing, float *y) {
    const long n_in = E + L + 2 * S, pairs = R * top_k;
    float *t = scratch, *weights = t + R * n_in, *rows = weights + pairs, *gate_up = rows + pairs * L;
    float *act = gate_up + pairs * 2 * I, *outs = act + pairs * I, *routed = outs + pairs * L;
    float *normed = routed + R * L, *shared_act = normed + R * L, *shared = shared_act + R * S;
    long *ids = iscratch, *order = ids + pairs, *counts = order + pairs;
    product(w_in, w_in_panels, x, t, n_in, d, R, row_major);
    moe_route(R, E, t, n_in, bias, top_k, renormalize, scaling, weights, ids);
    for (long e = 0; e < E; e++)
        counts[e] = 0;
    for (long j = 0; j < pairs; j++)
        counts[ids[j]]++;
    long lacking = 0;
    for (long e = 0; e < E; e++)
        if (counts[e] > row_major && (!w13_panels[e] || !w2_panels[e]))
            missing[lacking++] = e;
    if (lacking)
        return lacking;
    long start[E];
    for (long e = 0, at = 0; e < E; e++) {           /* a stable counting sort: argsort(ids, stable) */
        start[e] = at;
        at += counts[e];
    }
    for (long j = 0; j < pairs; j++)
        order[start[ids[j]]++] = j;
    for (long j = 0; j < pairs; j++)
        memcpy(rows + j * L, t + (order[j] / top_k) * n_in + E, (size_t)L * sizeof(float));
    for (long e = 0, lo = 0; e < E; lo += counts[e], e++)
        if (counts[e])
            product((const float *)w13[e], (const float *)w13_panels[e], rows + lo * L, gate_up + lo * 2 * I,
                    2 * I, L, counts[e], row_major);
    situ_rows(pairs, I, gate_up, 2 * I, gate_up + I, 2 * I, beta, linear_beta, act);
    for (long e = 0, lo = 0; e < E; lo += counts[e], e++)
        if (counts[e])
            product((const float *)w2[e], (const float *)w2_panels[e], act + lo * I, outs + lo * L, L, I,
                    counts[e], row_major);
    for (long i = 0; i < R * L; i++)
        routed[i] = 0.0f;
    for (long j = 0; j < pairs; j++) {
        float *r = routed + (order[j] / top_k) * L;
        const float w = weights[order[j]], *o = outs + j * L;
        for (long c = 0; c < L; c++)
            r[c] += o[c] * w;
    }
    const float *latent = routed;
    if (norm_w) {
        rms_norm_rows(R, L, routed, L, norm_w, eps, normed);
        latent = normed;
    }
    product(w_up, w_up_panels, latent, y, d, L, R, row_major);
    if (S > 0) {
        situ_rows(R, S, t + E + L, n_in, t + E + L + S, n_in, beta, linear_beta, shared_act);
        product(w_down, w_down_panels, shared_act, shared, d, S, R, row_major);
        for (long i = 0; i < R * d; i++)
            y[i] = y[i] + shared[i];
    }
    return 0;
}

/* KDA's gated output norm (engine/model/kda.py) of rows [T] of H heads of D floats (x contiguous):
 * y = rms_norm(x_head) * w * sigmoid(gate), gate's rows `gate_step` apart with its heads contiguous. */
HOT void gated_rms_norm_rows(long T, long H, long D, const float *x, const float *w, float eps, const float *gate,
                             long gate_step, float *y) {
    for (long t = 0; t < T; t++)
        for (long h = 0; h < H; h++) {
            const float *row = x + (t * H + h) * D, *g = gate + t * gate_step + h * D;
            float *out = y + (t * H + h) * D;
            const float r = 1.0f / sqrtf(dot(row, row, D) / (float)D + eps);
            for (long d = 0; d < D; d++)
                out[d] = row[d] * r * w[d] * sigmoidf(g[d]);
        }
}

/* One token of each of R decoding sequences through a KDA layer after its input projections (a decode
 * step of up to sixteen rows): `kda_decode` on the cache in place (sequence r on slots[r]), the gated norm,
 * then o_proj on rowdot.c's kernels (`product`), as the Python path calls them (engine/model/kda.py's
 * `_rows_in_c`), so bitwise its result. qkv, gate and b_raw are rows `step` floats apart (views of the
 * fused input projection); raw [R][H K] contiguous. scratch: R (2 H V + H) floats. y [R][d]. */
HOT void kda_rows(long R, long H, long K, long V, long W, const float *qkv, long step, const float *kernel_t,
                  const float *raw, const float *a_h, const float *dt_bias, float lower, const float *b_raw,
                  float *conv_store, float *rec_store, const long *slots, float scale, const float *gate,
                  const float *norm_w, float eps, const float *w_o, const float *w_o_panels, long d, long row_major,
                  float *scratch, float *y) {
    float *o = scratch, *gated = o + R * H * V, *beta_logits = gated + R * H * V;
    for (long r = 0; r < R; r++)                         /* as the Python path's `.contiguous()` copy */
        memcpy(beta_logits + r * H, b_raw + r * step, (size_t)H * sizeof(float));
    kda_decode(R, 1, H, K, V, W, qkv, step, kernel_t, raw, a_h, dt_bias, lower, beta_logits, conv_store, rec_store,
               slots, 0, scale, o);
    gated_rms_norm_rows(R, H, V, o, norm_w, eps, gate, step, gated);
    product(w_o, w_o_panels, gated, y, d, H * V, R, row_major);
}

/* A layer's AttnRes mixing followed by the norm in front of its mixer or FFN (engine/model/kimi_k3.py):
 * `attn_res_rows`, then `rms_norm_rows` with `norm_w`, the two calls the Python path makes, so bitwise
 * its result. scratch: T D floats. */
HOT void attn_res_norm_rows(long n, const float *const *sources, long T, long D, const float *query, float eps,
                            const float *norm_w, float norm_eps, float *scratch, float *out) {
    attn_res_rows(n, sources, T, D, query, eps, scratch);
    rms_norm_rows(T, D, scratch, D, norm_w, norm_eps, out);
}

/* MLA's output gate (engine/model/mla.py): y = x * sigmoid(g) for rows [T] of n floats (x contiguous,
 * g's rows `g_step` apart). */
HOT void sigmoid_gate_rows(long T, long n, const float *x, const float *g, long g_step, float *y) {
    for (long t = 0; t < T; t++)
        for (long i = 0; i < n; i++)
            y[t * n + i] = x[t * n + i] * sigmoidf(g[t * g_step + i]);
}

/* One token of each of R decoding sequences through a gated MLA layer (a decode step of up to sixteen
 * rows): the fused input projection [q_a QL | kv_a KL + RP | g H V], q = W_qb rms_norm(q_a), the latent
 * [rms_norm(c) | k_pe] written to pages[write[r]], `mla_attend`, the gate, o_proj: the calls the Python
 * path makes (engine/model/mla.py's `_rows_in_c`), so bitwise its result. Products as `moe_rows` makes
 * them. scratch: R (n_in + QL + H (nope + RP) + 2 H V + 2 H KL) + H max(1, longest) floats. y [R][d]. */
HOT void mla_rows(long R, long d, long QL, long KL, long RP, long H, long nope, long V, long row_major,
                  const float *x, const float *w_in, const float *w_in_panels, const float *q_norm_w, float q_eps,
                  const float *w_qb, const float *w_qb_panels, const float *kv_norm_w, float kv_eps, float *pages,
                  const long *write, const long *index, const long *starts, const long *lens, const float *w_uk,
                  const float *w_uv, float scale, const float *w_o, const float *w_o_panels, float *scratch,
                  float *y) {
    const long n_in = QL + KL + RP + H * V, width = KL + RP, qdim = nope + RP;
    float *t = scratch, *qn = t + R * n_in, *q = qn + R * QL, *out = q + R * H * qdim, *gated = out + R * H * V;
    float *attend = gated + R * H * V;
    product(w_in, w_in_panels, x, t, n_in, d, R, row_major);
    rms_norm_rows(R, QL, t, n_in, q_norm_w, q_eps, qn);
    product(w_qb, w_qb_panels, qn, q, H * qdim, QL, R, row_major);
    for (long r = 0; r < R; r++) {
        float *slot = pages + write[r] * width;
        rms_norm_rows(1, KL, t + r * n_in + QL, n_in, kv_norm_w, kv_eps, slot);
        memcpy(slot + KL, t + r * n_in + QL + KL, (size_t)RP * sizeof(float));
    }
    mla_attend(R, H, nope, RP, KL, V, q, pages, index, starts, lens, w_uk, w_uv, scale, attend, out);
    sigmoid_gate_rows(R, H * V, out, t + QL + KL + RP, n_in, gated);
    product(w_o, w_o_panels, gated, y, d, H * V, R, row_major);
}
