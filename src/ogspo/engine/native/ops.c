/* Fused non-matmul work of a Llama decoder layer for single-sequence tree forwards.
 *
 * Why: on a 2-core CPU a 1-token step of a 30-layer model runs ~30 small torch ops per layer
 * (norms, rotary embedding, cache writes, attention, activation), each costing a few
 * microseconds of dispatch: ~10 ms of a ~35 ms step that should be all weight streaming. These
 * three functions do that work in three calls per layer:
 *
 *   ogspo_add_rmsnorm     x += r (the residual branch, optional); h = x / rms(x) * w
 *   ogspo_rope_attention  bias + rotary embedding of q and k, k/v written to the cache rows,
 *                         attention of every new row over the committed rows and the pending
 *                         rows its tree mask allows; output [m, H * hd] ready for o_proj
 *   ogspo_silu_mul        a = silu(g) * u over the fused gate/up output [m, 2 * inter]
 *
 * Vectorised with the compiler's vector extension (16 floats with AVX-512, 8 with AVX2); exp is
 * a Cephes-style polynomial on whole vectors (~1 ulp), the same code for every lane. The head
 * dimension must be a multiple of the vector width (the Python side checks).
 *
 * Numerics: each output row is computed from its own input row by one fixed sequence of float
 * operations; attention visits exactly the keys a row may see, in ascending cache order, and
 * skips the others (a masked key is never added as a zero). So a token's result is bitwise the
 * same whether it is verified alone or inside a tree of any size, provided its visible keys hold
 * the same values (batch invariance of the layer, as of the native GEMM).
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#define DCH 16 /* value columns per pass of the lane-parallel value sum (accumulator registers) */
#else
#define VW 8
#define DCH 8
#endif

typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));

int ogspo_ops_vector_width(void) { return VW; }

static inline vf vload(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf vset(float x) { return (vf){0} + x; }

/* Sum of the lanes by a fixed tree (halves added pairwise). */
static inline float hsum(vf v) {
    float a[VW];
    vstore(a, v);
    for (int w = VW / 2; w >= 1; w /= 2)
        for (int l = 0; l < w; l++) a[l] += a[l + w];
    return a[0];
}

static inline vf vmin(vf a, vf b) { vi lt = a < b; return (vf)(((vi)a & lt) | ((vi)b & ~lt)); }
static inline vf vmax(vf a, vf b) { vi gt = a > b; return (vf)(((vi)a & gt) | ((vi)b & ~gt)); }

/* exp(x) lane-wise: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-7 polynomial (Cephes expf). */
static inline vf vexp(vf x) {
    x = vmax(vmin(x, vset(88.3762626647949f)), vset(-87.3365447504019f));
    vf shifter = vset(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf n = (x * vset(1.44269504088896341f) + shifter) - shifter;
    vf r = x - n * vset(0.693359375f) - n * vset(-2.12194440e-4f);
    vf p = vset(1.9875691500e-4f);
    p = p * r + vset(1.3981999507e-3f);
    p = p * r + vset(8.3334519073e-3f);
    p = p * r + vset(4.1665795894e-2f);
    p = p * r + vset(1.6666665459e-1f);
    p = p * r + vset(5.0000001201e-1f);
    p = p * (r * r) + r + vset(1.0f);
    return p * (vf)((__builtin_convertvector(n, vi) + 127) << 23);
}

void ogspo_add_rmsnorm(float *x, const float *r, const float *w, float *h, int64_t rows, int64_t dim, float eps) {
    for (int64_t i = 0; i < rows; i++) {
        float *xi = x + i * dim, *hi = h + i * dim;
        if (r) {
            const float *ri = r + i * dim;
            for (int64_t d = 0; d < dim; d++) xi[d] += ri[d];
        }
        vf acc = {0};
        int64_t d = 0;
        for (; d + VW <= dim; d += VW) {
            vf v = vload(xi + d);
            acc += v * v;
        }
        float s = hsum(acc);
        for (; d < dim; d++) s += xi[d] * xi[d];
        float inv = 1.f / sqrtf(s / (float)dim + eps);
        for (d = 0; d < dim; d++) hi[d] = xi[d] * inv * w[d];
    }
}

void ogspo_silu_mul(const float *gu, float *a, int64_t rows, int64_t inter) {
    for (int64_t i = 0; i < rows; i++) {
        const float *g = gu + i * 2 * inter, *u = g + inter;
        float *ai = a + i * inter;
        int64_t j = 0;
        for (; j + VW <= inter; j += VW) {
            vf gv = vload(g + j);
            vstore(ai + j, gv / (vset(1.f) + vexp(-gv)) * vload(u + j));
        }
        for (; j < inter; j += VW) { /* the tail, through a zero-padded vector: the same code per lane */
            float gb[VW] = {0}, ub[VW] = {0}, ab[VW];
            int64_t n = inter - j < VW ? inter - j : VW;
            memcpy(gb, g + j, n * 4);
            memcpy(ub, u + j, n * 4);
            vf gv = vload(gb);
            vstore(ab, gv / (vset(1.f) + vexp(-gv)) * vload(ub));
            memcpy(ai + j, ab, n * 4);
        }
    }
}

/* x [hd] -> out [hd]: x * cos + rotate_half(x) * sin (rotate_half(x) = [-x2, x1]). */
static inline void rope(const float *x, const float *cs, const float *sn, float *out, int64_t hd) {
    int64_t half = hd / 2;
    for (int64_t d = 0; d < half; d++) out[d] = x[d] * cs[d] - x[d + half] * sn[d];
    for (int64_t d = half; d < hd; d++) out[d] = x[d] * cs[d] + x[d - half] * sn[d];
}

/* Status codes of ogspo_rope_attention (the Python side raises one line for each). */
#define OGSPO_OK 0
#define OGSPO_BAD_SHAPE 1   /* m, heads or head dimension out of range */
#define OGSPO_OUT_OF_CACHE 2 /* committed <= start and start + m <= max_len do not hold */
#define OGSPO_BAD_POSITION 3 /* a position outside the rotary table's rows */
#define OGSPO_NO_MEMORY 4

/* qkv [m, (H + 2KV) * hd] (bias [(H + 2KV) * hd] or NULL), positions [m], cos/sin [table_len, hd];
 * caches kc/vc [KV, max_len, hd]; the m new rows go to cache rows start..start+m. Row i sees every
 * committed row (0..committed), and of the pending rows committed..start+m those with
 * attend[i, j - committed] != 0 (attend [m, start - committed + m]); attend NULL means causal
 * (row i sees rows up to start + i). out [m, H * hd].
 *
 * Per KV head, the group's queries (H / KV heads x m rows) lie across vector lanes: a score is
 * one FMA chain over the head dimension (a key element broadcast against the lanes), softmax
 * and the value sum run over keys in cache order per lane, and an invisible key's weight is an
 * exact zero (adding it changes no bit). Nothing depends on a query's lane or on which other
 * queries share the call. */
int ogspo_rope_attention(const float *qkv, const float *bias, const int64_t *positions, const float *cos_t,
                         const float *sin_t, int64_t table_len, float *kc, float *vc, int64_t max_len, int64_t start,
                         int64_t committed, const uint8_t *attend, int64_t m, int64_t H, int64_t KV, int64_t hd, float *out,
                         int threads) {
    if (m <= 0 || KV <= 0 || H <= 0 || H % KV != 0 || hd <= 0 || hd % VW != 0) return OGSPO_BAD_SHAPE;
    if (committed < 0 || committed > start || start + m > max_len) return OGSPO_OUT_OF_CACHE;
    for (int64_t i = 0; i < m; i++)
        if (positions[i] < 0 || positions[i] >= table_len) return OGSPO_BAD_POSITION;
    if (threads < 1) threads = 1;
    const int64_t width = (H + 2 * KV) * hd, end = start + m, group = H / KV, pending = end - committed;
    const int64_t nq = group * m, nb = (nq + VW - 1) / VW; /* queries of a group, lane blocks */
    const float scale = 1.f / sqrtf((float)hd);
    float *qt = malloc(sizeof(float) * KV * hd * nb * VW); /* [KV][hd][nb * VW]: roped queries, query q = i * group + h % group */
    if (!qt) return OGSPO_NO_MEMORY;
    memset(qt, 0, sizeof(float) * KV * hd * nb * VW);
    int failed = 0; /* an allocation inside the parallel loop failed: its block is skipped, the call reports it */
    float tmp[hd], rq[hd];
    for (int64_t i = 0; i < m; i++) {
        const float *row = qkv + i * width, *cs = cos_t + positions[i] * hd, *sn = sin_t + positions[i] * hd;
        for (int64_t c = 0; c < H + 2 * KV; c++) {
            const float *x = row + c * hd;
            if (bias) {
                for (int64_t d = 0; d < hd; d++) tmp[d] = x[d] + bias[c * hd + d];
                x = tmp;
            }
            if (c < H) {
                rope(x, cs, sn, rq, hd);
                float *dst = qt + (c / group) * hd * nb * VW + i * group + c % group;
                for (int64_t d = 0; d < hd; d++) dst[d * nb * VW] = rq[d] * scale;
            } else if (c < H + KV) {
                rope(x, cs, sn, kc + ((c - H) * max_len + start + i) * hd, hd);
            } else {
                memcpy(vc + ((c - H - KV) * max_len + start + i) * hd, x, hd * 4);
            }
        }
    }
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1) collapse(2)
    for (int64_t g = 0; g < KV; g++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *Q = qt + g * hd * nb * VW + b * VW, *K = kc + g * max_len * hd, *V = vc + g * max_len * hd;
            const int64_t ldq = nb * VW;
            vf *S = aligned_alloc(sizeof(vf), sizeof(vf) * end); /* scores, then weights: [end] x lanes */
            vi *vis = aligned_alloc(sizeof(vi), sizeof(vi) * (pending > 0 ? pending : 1));
            if (!S || !vis) {
                free(S);
                free(vis);
#pragma omp atomic write
                failed = 1;
                continue;
            }
            /* scores, 8 keys at a time; the last keys through the same code on a zero-padded copy, so a
             * key's score is one instruction sequence wherever it falls (a separate tail loop compiled
             * differently on AVX2 Zen 3 with -march=native, and a row alone then differed from the same
             * row in a tree) */
            float kpad[8 * hd];
            int64_t j = 0;
            for (; j < end; j += 8) {
                const float *k = K + j * hd;
                const int64_t n = end - j < 8 ? end - j : 8;
                if (n < 8) {
                    memset(kpad, 0, sizeof(kpad));
                    memcpy(kpad, k, sizeof(float) * n * hd);
                    k = kpad;
                }
                vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};
                for (int64_t d = 0; d < hd; d++) {
                    vf q = vload(Q + d * ldq);
                    a0 += q * k[d];
                    a1 += q * k[hd + d];
                    a2 += q * k[2 * hd + d];
                    a3 += q * k[3 * hd + d];
                    a4 += q * k[4 * hd + d];
                    a5 += q * k[5 * hd + d];
                    a6 += q * k[6 * hd + d];
                    a7 += q * k[7 * hd + d];
                }
                const vf a[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
                for (int64_t t = 0; t < n; t++) S[j + t] = a[t];
            }
            /* masks of the pending keys: vis[l] = 1 where lane l may see key j */
            vi lanes_valid;
            for (int l = 0; l < VW; l++) lanes_valid[l] = b * VW + l < nq ? -1 : 0;
            vf mx = vset(-INFINITY);
            for (j = 0; j < committed; j++) mx = vmax(mx, S[j]);
            for (j = committed; j < end; j++) {
                vi v = {0};
                for (int l = 0; l < VW; l++) {
                    int64_t q = b * VW + l, i = q / group;
                    int ok = q < nq && (attend ? attend[i * pending + (j - committed)] != 0 : j <= start + i);
                    v[l] = ok ? -1 : 0;
                }
                vis[j - committed] = v;
                mx = (vf)(((vi)vmax(mx, S[j]) & v) | ((vi)mx & ~v));
            }
            mx = (vf)(((vi)mx & lanes_valid) | ((vi)vset(0.f) & ~lanes_valid)); /* padding lanes: finite */
            vf sum = {0};
            for (j = 0; j < end; j++) {
                vf p = vexp(S[j] - mx);
                if (j >= committed) p = (vf)((vi)p & vis[j - committed]);
                S[j] = p;
                sum += p;
            }
            /* weighted values: O[q, d] = sum_j p[j, q] v[j, d], one FMA chain over j per (q, d)
             * either way below (an FMA's two factors commute exactly, so both give the same bits) */
            int valid = nq - b * VW < VW ? (int)(nq - b * VW) : VW;
            if (2 * valid >= VW && hd % DCH == 0) {
                /* queries across lanes, DCH value columns at a time, each broadcast against the lanes */
                for (int64_t d0 = 0; d0 < hd; d0 += DCH) {
                    vf acc[DCH];
                    for (int dd = 0; dd < DCH; dd++) acc[dd] = (vf){0};
                    for (j = 0; j < end; j++) {
                        const vf p = S[j];
                        const float *v = V + j * hd + d0;
                        for (int dd = 0; dd < DCH; dd++) acc[dd] += p * v[dd];
                    }
                    for (int l = 0; l < valid; l++) {
                        int64_t q = b * VW + l, i = q / group, h = g * group + q % group;
                        float inv = 1.f / sum[l], *o = out + i * H * hd + h * hd + d0;
                        for (int dd = 0; dd < DCH; dd++) o[dd] = acc[dd][l] * inv;
                    }
                }
            } else {
                /* few queries: two at a time, the value row across lanes */
                for (int l = 0; l < valid; l += 2) {
                    const int two = l + 1 < valid;
                    vf acc0[hd / VW], acc1[hd / VW];
                    for (int64_t d = 0; d < hd / VW; d++) acc0[d] = acc1[d] = (vf){0};
                    for (j = 0; j < end; j++) {
                        vf p0 = vset(S[j][l]), p1 = vset(two ? S[j][l + 1] : 0.f);
                        const float *v = V + j * hd;
                        for (int64_t d = 0; d < hd / VW; d++) {
                            vf vv = vload(v + d * VW);
                            acc0[d] += p0 * vv;
                            acc1[d] += p1 * vv;
                        }
                    }
                    for (int u = 0; u <= two; u++) {
                        int64_t q = b * VW + l + u, i = q / group, h = g * group + q % group;
                        float inv = 1.f / sum[l + u], *o = out + i * H * hd + h * hd;
                        for (int64_t d = 0; d < hd / VW; d++) {
                            float tmp_o[VW];
                            vstore(tmp_o, u ? acc1[d] : acc0[d]);
                            for (int t = 0; t < VW; t++) o[d * VW + t] = tmp_o[t] * inv;
                        }
                    }
                }
            }
            free(vis);
            free(S);
        }
    }
    free(qt);
    return failed ? OGSPO_NO_MEMORY : OGSPO_OK;
}
