/* Small-row fp32 GEMM for verification forwards: Y[m, out] = X[m, in] @ W^T.
 *
 * Why: a tree forward multiplies m = 1..64 rows by every weight matrix of the target. At these
 * row counts each weight is read from memory once per forward, so a forward should cost about
 * what a 1-row step does until the arithmetic outgrows the memory time (~10-16 rows on a 2-core
 * CPU). BLAS sgemm is tuned for large m; this kernel streams a pre-packed weight once and feeds
 * every loaded weight vector to all rows of a row block held in registers.
 *
 * Packed layout (`ogspo_pack`): panels of PW = 2 * VW output columns (VW = 16 floats with
 * AVX-512, 8 with AVX2); panel p holds W[p*PW : (p+1)*PW, :] transposed, as [in][PW] contiguous
 * floats (out zero-padded to a multiple of PW). One k step of a panel is two aligned vector loads.
 *
 * Register blocking: a micro-kernel runs MR rows against NP panels with MR * NP * 2 vector
 * accumulators (at most ACC); few rows take several panels at once so that enough independent
 * FMAs are in flight. Each thread takes a contiguous range of panels, prefetched PF k steps ahead.
 *
 * More rows than MR_MAX: row blocks of MR_MAX and a remainder (full blocks first measured 3-8% faster
 * than balanced ones at 13-16 rows on the 2-core Xeon), each block a pass over the panels. The
 * panels go in groups of a quarter of the core's L2, and while the passes run over one group they
 * prefetch the next one, each pass its share: so the one read of a weight from memory overlaps the
 * arithmetic of all row blocks, and every pass finds its panels in L2. Without the overlap the
 * first pass over a group waits on memory with the FMA units half idle, the later ones compute with
 * memory idle: 7-20 rows cost 12-20% more on the 2-core Zen 3 (whole-model sweeps, interleaved).
 *
 * Numerics: every output element is the same sequence of fused multiply-adds over k = 0..in-1
 * whatever the row count, row block, panel grouping or thread, so a row's result is bitwise
 * independent of how many rows share the call (batch invariance).
 *
 * Built at first use by ogspo.engine.native with the machine's C compiler (-O3 -march=native
 * -fopenmp), sharing the OpenMP runtime torch already loaded.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#if defined(__AVX512F__)
#define VW 16
#define ACC 24   /* of 32 vector registers */
#define MR_MAX 12
#define NP_MAX 8
#else
#define VW 8
#define ACC 12   /* of 16 vector registers */
#define MR_MAX 6
#define NP_MAX 4
#endif
#define NB 2
#define PW (NB * VW)
#ifndef PF
#define PF 32    /* software prefetch distance in k steps (4 KB ahead with AVX-512) */
#endif
#define LINE 64  /* cache line bytes */

typedef float vf __attribute__((vector_size(VW * 4)));

int ogspo_panel_width(void) { return PW; }
int ogspo_vector_width(void) { return VW; }

/* w: [out, in] row-major -> packed: [ceil(out / PW)][in][PW]. */
void ogspo_pack(const float *w, int64_t out, int64_t in, float *packed) {
    int64_t panels = (out + PW - 1) / PW;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * in * PW;
        for (int64_t k = 0; k < in; k++)
            for (int64_t j = 0; j < PW; j++) {
                int64_t o = p * PW + j;
                dst[k * PW + j] = o < out ? w[o * in + k] : 0.0f;
            }
    }
}

/* One micro-kernel: MR rows x NP panels (MR, NP literal constants, so the accumulators live in
 * registers). Besides its own panels it prefetches nf cache lines from `ahead` (the next group's
 * share of this call; nf = 0: none), spread evenly over its k steps. */
#define MICRO(NAME, MR, NP)                                                                                \
    static void NAME(const float *x, int64_t ldx, const float *p0, int64_t in, float *y, int64_t ldy,      \
                     int64_t col0, int64_t out, const char *ahead, int64_t nf) {                          \
        vf acc[MR][(NP) * NB];                                                                            \
        memset(acc, 0, sizeof(acc));                                                                      \
        int64_t due = 0;                                                                                  \
        for (int64_t k = 0; k < in; k++) {                                                                \
            for (due += nf; due >= in; due -= in, ahead += LINE) __builtin_prefetch(ahead, 0, 2);         \
            vf w[(NP) * NB];                                                                              \
            for (int q = 0; q < (NP); q++) {                                                              \
                const float *pk = p0 + (int64_t)q * in * PW + k * PW;                                     \
                for (int b = 0; b < PW; b += 16) __builtin_prefetch(pk + PF * PW + b, 0, 1);              \
                for (int b = 0; b < NB; b++) w[q * NB + b] = *(const vf *)(pk + b * VW);                  \
            }                                                                                             \
            for (int r = 0; r < (MR); r++) {                                                              \
                float xv = x[r * ldx + k];                                                                \
                for (int v = 0; v < (NP) * NB; v++) acc[r][v] = xv * w[v] + acc[r][v];                    \
            }                                                                                             \
        }                                                                                                 \
        for (int r = 0; r < (MR); r++)                                                                    \
            for (int v = 0; v < (NP) * NB; v++) {                                                         \
                int64_t c = col0 + (v / NB) * PW + (v % NB) * VW;                                         \
                if (c + VW <= out) memcpy(y + r * ldy + c, &acc[r][v], VW * 4);                           \
                else if (c < out) memcpy(y + r * ldy + c, &acc[r][v], (out - c) * 4);                     \
            }                                                                                             \
    }

#define NP_OF(r) (ACC / ((r) * NB) < 1 ? 1 : (ACC / ((r) * NB) > NP_MAX ? NP_MAX : ACC / ((r) * NB)))
typedef void (*micro_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int64_t, int64_t, const char *,
                         int64_t);
#define DEF(r) MICRO(mn_##r, r, NP_OF(r)) MICRO(m1_##r, r, 1)
DEF(1) DEF(2) DEF(3) DEF(4) DEF(5) DEF(6)
#if MR_MAX > 6
DEF(7) DEF(8) DEF(9) DEF(10) DEF(11) DEF(12)
static const micro_fn MN[] = {0, mn_1, mn_2, mn_3, mn_4, mn_5, mn_6, mn_7, mn_8, mn_9, mn_10, mn_11, mn_12};
static const micro_fn M1[] = {0, m1_1, m1_2, m1_3, m1_4, m1_5, m1_6, m1_7, m1_8, m1_9, m1_10, m1_11, m1_12};
#else
static const micro_fn MN[] = {0, mn_1, mn_2, mn_3, mn_4, mn_5, mn_6};
static const micro_fn M1[] = {0, m1_1, m1_2, m1_3, m1_4, m1_5, m1_6};
#endif

/* Bytes of one core's L2 (the panel groups are sized from it); 512 KB where the OS does not say. */
static int64_t l2_bytes(void) {
    static int64_t bytes = 0;
    if (bytes == 0) {
        long b = sysconf(_SC_LEVEL2_CACHE_SIZE);
        bytes = b > 0 ? b : 512 * 1024;
    }
    return bytes;
}

/* y[m, out] = x[m, in] @ W^T from the packed weight, on `threads` OpenMP threads. */
void ogspo_gemm(const float *x, int64_t m, int64_t in, const float *packed, int64_t out, float *y, int threads) {
    if (m <= 0 || in <= 0 || out <= 0) return; /* nothing to compute (and NP_OF(0) would divide by zero) */
    if (threads < 1) threads = 1;
    int64_t panels = (out + PW - 1) / PW;
    int64_t passes = (m + MR_MAX - 1) / MR_MAX;
    int64_t block = m > MR_MAX ? MR_MAX : m; /* full row blocks first */
    int64_t panel_bytes = in * PW * 4, l2 = l2_bytes();
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t p_begin = panels * t / nt, p_end = panels * (t + 1) / nt;
        /* With several row blocks, panels go in groups of a quarter of L2 (this group and the next
         * one being prefetched fit with room to spare); a group is a multiple of the first block's
         * panel count. */
        int64_t np0 = NP_OF(block), group = p_end - p_begin;
        if (passes > 1) {
            group = l2 / 4 / panel_bytes / np0 * np0;
            if (group < np0) group = np0;
        }
        for (int64_t g = p_begin; g < p_end; g += group) {
            int64_t g_end = g + group < p_end ? g + group : p_end;
            for (int64_t r = 0; r < m; r += block) {
                int64_t mr = m - r < block ? m - r : block;
                int64_t np = NP_OF(mr);
                for (int64_t p = g; p < g_end;) {
                    const float *p0 = packed + p * in * PW;
                    int64_t take = g_end - p >= np ? np : 1;
                    /* the next group's panels p + group .. (those of this thread): this pass prefetches
                     * its share of their lines */
                    const char *ahead = 0;
                    int64_t nf = 0, next = p_end - (p + group) < take ? p_end - (p + group) : take;
                    if (passes > 1 && next > 0) {
                        int64_t lines = next * panel_bytes / LINE, pass = r / block;
                        int64_t first = lines * pass / passes;
                        ahead = (const char *)(packed + (p + group) * in * PW) + first * LINE;
                        nf = lines * (pass + 1) / passes - first;
                    }
                    (take == np ? MN : M1)[mr](x + r * in, in, p0, in, y + r * out, out, p * PW, out, ahead, nf);
                    p += take;
                }
            }
        }
    }
}
