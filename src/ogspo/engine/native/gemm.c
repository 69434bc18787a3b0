/* Small-row fp32 GEMM for verification forwards: Y[m, out] = X[m, in] @ W^T (+ nothing else).
 *
 * Why: a tree forward multiplies m = 1..64 rows by every weight matrix of the target. At these
 * row counts a weight is read from memory once per forward, so the forward should cost about
 * what a 1-row step does until the arithmetic outgrows the memory time (~10-16 rows on a 2-core
 * CPU). BLAS sgemm is tuned for large m and re-packs or under-uses registers at small m; this
 * kernel streams a pre-packed weight once and feeds every loaded weight vector to all rows.
 *
 * Packed layout (`ogspo_pack`): panels of PW = NB * VW output columns; panel p holds
 * W[p*PW : (p+1)*PW, :] transposed, as [in][PW] contiguous floats (out is zero-padded to a
 * multiple of PW). One k step of a panel is NB aligned vector loads.
 *
 * Numerics: every output element is the same sequence of fused multiply-adds over k = 0..in-1,
 * whatever the row count, the row block it falls in and the thread that runs it. A row's result
 * is therefore bitwise independent of how many rows share the call (batch invariance), so a tree
 * forward reproduces the autoregressive step exactly.
 *
 * Built at first use by ogspo.engine.native with the machine's C compiler (-O3 -march=native
 * -fopenmp), linked against the OpenMP runtime torch already loaded.
 */
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#else
#define VW 8
#endif
#define NB 2
#define PW (NB * VW)
/* Software prefetch of the weight stream, PF k steps ahead (2 KB at PW = 32), into L2 (locality
 * hint 1): hardware prefetchers alone left the FMA-heavy multi-row loops waiting on memory. */
#ifndef PF
#define PF 16
#endif
#ifndef PFL
#define PFL 1
#endif

typedef float vf __attribute__((vector_size(VW * 4)));

int ogspo_panel_width(void) { return PW; }
int ogspo_vector_width(void) { return VW; }

/* w: [out, in] row-major; packed: [ceil(out / PW)][in][PW]. */
void ogspo_pack(const float *w, int64_t out, int64_t in, float *packed) {
    int64_t panels = (out + PW - 1) / PW;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * in * PW;
        for (int64_t k = 0; k < in; k++) {
            for (int64_t j = 0; j < PW; j++) {
                int64_t o = p * PW + j;
                dst[k * PW + j] = o < out ? w[o * in + k] : 0.0f;
            }
        }
    }
}

/* MR rows x NP panels: acc[MR][NP*NB] vectors held in registers. */
#define MICRO(MR, NP)                                                                                 \
    static void micro_##MR##_##NP(const float *x, int64_t ldx, const float *p0, int64_t in,           \
                                  float *y, int64_t ldy, int64_t col0, int64_t out) {                  \
        vf acc[MR][NP * NB];                                                                          \
        memset(acc, 0, sizeof(acc));                                                                  \
        for (int64_t k = 0; k < in; k++) {                                                            \
            vf w[NP * NB];                                                                            \
            for (int q = 0; q < NP; q++)                                                              \
                for (int b = 0; b < NB * VW; b += 16)                                                 \
                    __builtin_prefetch(p0 + (int64_t)q * in * PW + (k + PF) * PW + b, 0, PFL);           \
            for (int q = 0; q < NP; q++)                                                              \
                for (int b = 0; b < NB; b++)                                                          \
                    w[q * NB + b] = *(const vf *)(p0 + (int64_t)q * in * PW + k * PW + b * VW);       \
            for (int r = 0; r < MR; r++) {                                                            \
                float xv = x[r * ldx + k];                                                            \
                for (int v = 0; v < NP * NB; v++) acc[r][v] = xv * w[v] + acc[r][v]; \
            }                                                                                         \
        }                                                                                             \
        for (int r = 0; r < MR; r++)                                                                  \
            for (int q = 0; q < NP; q++)                                                              \
                for (int b = 0; b < NB; b++) {                                                        \
                    int64_t c = col0 + q * PW + b * VW;                                               \
                    float *dst = y + r * ldy + c;                                                     \
                    if (c + VW <= out) {                                                              \
                        memcpy(dst, &acc[r][q * NB + b], VW * 4);                                     \
                    } else if (c < out) {                                                             \
                        memcpy(dst, &acc[r][q * NB + b], (out - c) * 4);                              \
                    }                                                                                 \
                }                                                                                     \
    }

/* Register budgets: 32 vector registers with AVX-512, 16 with AVX2 (a vf of 8 floats each). */
#if VW == 16
MICRO(1, 4)
MICRO(2, 2)
MICRO(4, 1)
MICRO(8, 1)
MICRO(12, 1)
#define MR_MAX 12
#else
MICRO(1, 2)
MICRO(2, 2)
MICRO(4, 1)
MICRO(6, 1)
#define MR_MAX 6
#endif

/* rows r..r+mr of x against panels p..p+np; returns the number of panels consumed. */
static int64_t run_block(const float *x, int64_t ldx, int64_t mr, const float *packed, int64_t in,
                         int64_t p, int64_t np_left, float *y, int64_t ldy, int64_t out) {
    const float *p0 = packed + p * in * PW;
    int64_t col0 = p * PW;
#if VW == 16
    if (mr == 1 && np_left >= 4) { micro_1_4(x, ldx, p0, in, y, ldy, col0, out); return 4; }
    if (mr == 2 && np_left >= 2) { micro_2_2(x, ldx, p0, in, y, ldy, col0, out); return 2; }
    if (mr >= 12) { micro_12_1(x, ldx, p0, in, y, ldy, col0, out); return 1; }
    if (mr >= 8) { micro_8_1(x, ldx, p0, in, y, ldy, col0, out); return 1; }
#else
    if (mr == 1 && np_left >= 2) { micro_1_2(x, ldx, p0, in, y, ldy, col0, out); return 2; }
    if (mr == 2 && np_left >= 2) { micro_2_2(x, ldx, p0, in, y, ldy, col0, out); return 2; }
    if (mr >= 6) { micro_6_1(x, ldx, p0, in, y, ldy, col0, out); return 1; }
#endif
    if (mr >= 4) { micro_4_1(x, ldx, p0, in, y, ldy, col0, out); return 1; }
    /* 1-3 rows on a single panel (or the last panels): row by row, one panel */
    for (int64_t r = 0; r < mr; r++) {
        vf acc[NB];
        memset(acc, 0, sizeof(acc));
        for (int64_t k = 0; k < in; k++) {
            float xv = x[r * ldx + k];
            for (int b = 0; b < NB * VW; b += 16) __builtin_prefetch(p0 + (k + PF) * PW + b, 0, PFL);
            for (int b = 0; b < NB; b++) acc[b] = xv * *(const vf *)(p0 + k * PW + b * VW) + acc[b];
        }
        for (int b = 0; b < NB; b++) {
            int64_t c = col0 + b * VW;
            if (c + VW <= out) memcpy(y + r * ldy + c, &acc[b], VW * 4);
            else if (c < out) memcpy(y + r * ldy + c, &acc[b], (out - c) * 4);
        }
    }
    return 1;
}

/* y[m, out] = x[m, in] @ W^T from the packed weight, on `threads` OpenMP threads (panels split
 * between threads; each thread runs all rows of its panels, row blocks of up to MR_MAX). */
void ogspo_gemm(const float *x, int64_t m, int64_t in, const float *packed, int64_t out, float *y,
                int threads) {
    int64_t panels = (out + PW - 1) / PW;
    int64_t chunk = 4; /* panels per work item: a multiple of every NP above */
    int64_t items = (panels + chunk - 1) / chunk;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t it = 0; it < items; it++) {
        int64_t p_end = (it + 1) * chunk < panels ? (it + 1) * chunk : panels;
        for (int64_t r = 0; r < m; r += MR_MAX) {
            int64_t mr = m - r < MR_MAX ? m - r : MR_MAX;
            /* split mr into blocks the micro-kernels cover exactly */
            int64_t done = 0;
            while (done < mr) {
                int64_t left = mr - done;
                int64_t blk = left >= MR_MAX ? MR_MAX : (left >= 8 && MR_MAX >= 8 ? 8 : (left >= 4 ? 4 : (left >= 2 ? 2 : 1)));
#if VW != 16
                if (blk == 8) blk = 6;
#endif
                for (int64_t p = it * chunk; p < p_end;) {
                    p += run_block(x + (r + done) * in, in, blk, packed, in, p, p_end - p, y + (r + done) * out,
                                   out, out);
                }
                done += blk;
            }
        }
    }
}
