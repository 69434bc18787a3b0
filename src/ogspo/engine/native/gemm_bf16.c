/* Small-row bf16 GEMM: Y[m, out] (fp32) = bf16(X[m, in]) @ W^T, W stored in bf16, fp32 accumulation.
 *
 * Why: a decode step streams every weight once, so its floor is the weights' bytes over the memory
 * bandwidth; bf16 weights halve it. With AVX512-BF16 (Zen 4, Cooper Lake, Sapphire Rapids and
 * later) one `vdpbf16ps` multiplies 16 pairs of bf16 and adds them to 16 fp32 accumulators, twice
 * the multiplies of an fp32 FMA, so the tree rows of a verification forward stay near the 1-row
 * cost for longer as well. This is llama.cpp's bf16 recipe (bf16 inputs, fp32 sums, fp32 output:
 * the logits are never rounded to bf16, which would manufacture ties).
 *
 * Packed layout (`ogspo_pack_bf16`): panels of PW = 32 output columns; panel p holds
 * W[p*PW : (p+1)*PW, :] as [in/2][PW][2] bf16, i.e. for each pair of inputs (k, k+1) the 32
 * columns' two weights side by side, as `vdpbf16ps` reads them (an odd `in` is zero-padded). One
 * pair step of a panel is two aligned 64-byte loads.
 *
 * The rows: X is rounded to bf16 (round to nearest even) once per call into [m][in/2] pairs; each
 * row's pair is broadcast against the panel vectors. Register blocking, row blocks, panel groups
 * per thread and prefetching are those of the fp32 kernel (gemm.c) as it was before its passes
 * prefetched the next group: groups of ~1 MB here, the overlap not yet measured on an AVX512-BF16 CPU.
 *
 * Numerics: every output element is one fixed sequence of `vdpbf16ps` over the pairs 0..in/2-1
 * whatever the row count, row block, panel grouping or thread: a row's result is bitwise the same
 * alone or among any number of rows (batch invariance), which the kernel calibration checks.
 *
 * Built only where the compiler targets AVX512-BF16 (`ogspo_bf16_available` says so); elsewhere a
 * bf16 target runs torch's kernels.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>

#define BVW 16            /* fp32 lanes per vector */
#define BPW (2 * BVW)     /* output columns per panel */
#define BACC 24           /* accumulators of 32 vector registers */
#define BMR_MAX 12
#define BNP_MAX 8
#ifndef BPF
#define BPF 32            /* prefetch distance in pair steps (4 KB ahead) */
#endif

int ogspo_bf16_available(void) { return 1; }
int ogspo_panel_width_bf16(void) { return BPW; }

/* w: [out, in] bf16 (uint16 bits) row-major -> packed [ceil(out / BPW)][ceil(in / 2)][BPW][2]. */
void ogspo_pack_bf16(const uint16_t *w, int64_t out, int64_t in, uint16_t *packed) {
    int64_t panels = (out + BPW - 1) / BPW, in2 = (in + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        uint16_t *dst = packed + p * in2 * BPW * 2;
        for (int64_t kk = 0; kk < in2; kk++)
            for (int64_t j = 0; j < BPW; j++)
                for (int h = 0; h < 2; h++) {
                    int64_t o = p * BPW + j, k = 2 * kk + h;
                    dst[(kk * BPW + j) * 2 + h] = (o < out && k < in) ? w[o * in + k] : 0;
                }
    }
}

/* fp32 -> bf16 bits, round to nearest even (NaN kept quiet). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#define BMICRO(NAME, MR, NP)                                                                              \
    static void NAME(const uint32_t *x, int64_t ldx, const uint16_t *p0, int64_t in2, float *y,          \
                     int64_t ldy, int64_t col0, int64_t out) {                                           \
        __m512 acc[MR][(NP) * 2];                                                                        \
        for (int r = 0; r < (MR); r++)                                                                   \
            for (int v = 0; v < (NP) * 2; v++) acc[r][v] = _mm512_setzero_ps();                         \
        for (int64_t kk = 0; kk < in2; kk++) {                                                           \
            __m512bh w[(NP) * 2];                                                                        \
            for (int q = 0; q < (NP); q++) {                                                             \
                const uint16_t *pk = p0 + ((int64_t)q * in2 + kk) * BPW * 2;                             \
                _mm_prefetch((const char *)(pk + BPF * BPW * 2), _MM_HINT_T1);                           \
                _mm_prefetch((const char *)(pk + BPF * BPW * 2 + 32), _MM_HINT_T1);                      \
                w[q * 2] = (__m512bh)_mm512_load_si512((const void *)pk);                                \
                w[q * 2 + 1] = (__m512bh)_mm512_load_si512((const void *)(pk + 32));                     \
            }                                                                                            \
            for (int r = 0; r < (MR); r++) {                                                             \
                __m512bh xv = (__m512bh)_mm512_set1_epi32((int)x[r * ldx + kk]);                         \
                for (int v = 0; v < (NP) * 2; v++) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xv, w[v]);    \
            }                                                                                            \
        }                                                                                                \
        for (int r = 0; r < (MR); r++)                                                                   \
            for (int v = 0; v < (NP) * 2; v++) {                                                         \
                int64_t c = col0 + (v / 2) * BPW + (v % 2) * BVW;                                        \
                if (c + BVW <= out) _mm512_storeu_ps(y + r * ldy + c, acc[r][v]);                        \
                else if (c < out) _mm512_mask_storeu_ps(y + r * ldy + c, (__mmask16)((1u << (out - c)) - 1), acc[r][v]); \
            }                                                                                            \
    }

#define BNP_OF(r) (BACC / ((r) * 2) < 1 ? 1 : (BACC / ((r) * 2) > BNP_MAX ? BNP_MAX : BACC / ((r) * 2)))
typedef void (*bmicro_fn)(const uint32_t *, int64_t, const uint16_t *, int64_t, float *, int64_t, int64_t, int64_t);
#define BDEF(r) BMICRO(bn_##r, r, BNP_OF(r)) BMICRO(b1_##r, r, 1)
BDEF(1) BDEF(2) BDEF(3) BDEF(4) BDEF(5) BDEF(6) BDEF(7) BDEF(8) BDEF(9) BDEF(10) BDEF(11) BDEF(12)
static const bmicro_fn BN[] = {0, bn_1, bn_2, bn_3, bn_4, bn_5, bn_6, bn_7, bn_8, bn_9, bn_10, bn_11, bn_12};
static const bmicro_fn B1[] = {0, b1_1, b1_2, b1_3, b1_4, b1_5, b1_6, b1_7, b1_8, b1_9, b1_10, b1_11, b1_12};

/* y[m, out] = bf16(x[m, in]) @ W^T from the packed bf16 weight, on `threads` OpenMP threads.
 * Returns 0, or 1 when the row buffer cannot be allocated. */
int ogspo_gemm_bf16(const float *x, int64_t m, int64_t in, const uint16_t *packed, int64_t out, float *y, int threads) {
    if (m <= 0 || in <= 0 || out <= 0) return 0;
    if (threads < 1) threads = 1;
    int64_t in2 = (in + 1) / 2;
    uint32_t *xb = (uint32_t *)malloc((size_t)(m * in2) * 4); /* [m][in2] pairs of bf16 */
    if (xb == NULL) return 1;
    for (int64_t r = 0; r < m; r++)
        for (int64_t kk = 0; kk < in2; kk++) {
            int64_t k = 2 * kk;
            uint32_t lo = to_bf16(x[r * in + k]), hi = k + 1 < in ? to_bf16(x[r * in + k + 1]) : 0;
            xb[r * in2 + kk] = lo | (hi << 16);
        }
    int64_t panels = (out + BPW - 1) / BPW;
    int64_t passes = (m + BMR_MAX - 1) / BMR_MAX;
    int64_t block = m > BMR_MAX ? BMR_MAX : m;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t p_begin = panels * t / nt, p_end = panels * (t + 1) / nt;
        int64_t np0 = BNP_OF(block), group = p_end - p_begin;
        if (passes > 1) { /* panels in ~1 MB groups, so row blocks after the first read them from L2 */
            group = ((int64_t)1 << 20) / (in2 * BPW * 4) / np0 * np0;
            if (group < np0) group = np0;
        }
        for (int64_t g = p_begin; g < p_end; g += group) {
            int64_t g_end = g + group < p_end ? g + group : p_end;
            for (int64_t r = 0; r < m; r += block) {
                int64_t mr = m - r < block ? m - r : block;
                int64_t np = BNP_OF(mr);
                for (int64_t p = g; p < g_end;) {
                    const uint16_t *p0 = packed + p * in2 * BPW * 2;
                    if (g_end - p >= np) {
                        BN[mr](xb + r * in2, in2, p0, in2, y + r * out, out, p * BPW, out);
                        p += np;
                    } else {
                        B1[mr](xb + r * in2, in2, p0, in2, y + r * out, out, p * BPW, out);
                        p += 1;
                    }
                }
            }
        }
    }
    free(xb);
    return 0;
}

#else /* no AVX512-BF16 in this build */

int ogspo_bf16_available(void) { return 0; }
int ogspo_panel_width_bf16(void) { return 0; }
void ogspo_pack_bf16(const uint16_t *w, int64_t out, int64_t in, uint16_t *packed) {
    (void)w; (void)out; (void)in; (void)packed;
}
int ogspo_gemm_bf16(const float *x, int64_t m, int64_t in, const uint16_t *packed, int64_t out, float *y, int threads) {
    (void)x; (void)m; (void)in; (void)packed; (void)out; (void)y; (void)threads;
    return 2;
}

#endif
