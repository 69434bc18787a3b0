/* One whole Llama decoder layer in one call, for single-sequence tree forwards of a few rows.
 *
 * Why: a 1-row step of SmolLM2-135M on 2 cores streams 8 ms of bf16 weights, but calling the layer
 * as eight steps from Python (four matmuls, three layer ops, their tensors) costs ~150 us a layer
 * on top: 30 layers, ~5 ms, a third of the step. This function chains the same kernels with no
 * Python in between:
 *
 *   h = rmsnorm(x) * ln1;  qkv = h @ Wqkv^T;  attn = rope_attention(qkv);  x += attn @ Wo^T
 *   h = rmsnorm(x) * ln2;  a = silu_mul(h @ Wgu^T);  x += a @ Wdown^T
 *
 * x [m, dim] is updated in place to the layer's output. The matmuls are the native GEMMs (fp32
 * `ogspo_gemm` or bf16 `ogspo_gemm_bf16`, on the thread count the kernel table chose for each class
 * at m rows); the layer ops are ops.c's. Every operation is the one the layer-by-layer path runs,
 * in the same order on the same values (the residual of the MLP is added here rather than at the
 * start of the next layer: the same float additions), so both paths give the same bits.
 *
 * scratch: m * (2 * dim + (H + 2 KV) * hd + H * hd + 3 * inter + dim) floats, owned by the caller.
 * Returns 0, rope_attention's status (1-4), or 4 when the bf16 GEMM cannot allocate its rows.
 */
#include <stdint.h>

void ogspo_gemm(const float *x, int64_t m, int64_t in, const float *packed, int64_t out, float *y, int threads);
int ogspo_gemm_bf16(const float *x, int64_t m, int64_t in, const uint16_t *packed, int64_t out, float *y, int threads);
void ogspo_add_rmsnorm(float *x, const float *r, const float *w, float *h, int64_t rows, int64_t dim, float eps);
void ogspo_silu_mul(const float *gu, float *a, int64_t rows, int64_t inter);
int ogspo_rope_attention(const float *qkv, const float *bias, const int64_t *positions, const float *cos_t,
                         const float *sin_t, int64_t rope_rows, float *keys, float *values, int64_t cache_rows,
                         int64_t start, int64_t committed, const uint8_t *attend, int64_t m, int64_t H, int64_t KV,
                         int64_t hd, float *out, int threads);

static int gemm(const float *x, int64_t m, int64_t in, const void *w, int64_t out, float *y, int threads, int bf16) {
    if (bf16) return ogspo_gemm_bf16(x, m, in, (const uint16_t *)w, out, y, threads) ? 4 : 0;
    ogspo_gemm(x, m, in, (const float *)w, out, y, threads);
    return 0;
}

/* threads: [qkv, o, gate_up, down, layer ops]. */
int ogspo_decoder_layer(float *x, int64_t m, int64_t dim, int64_t inter, const float *ln1, const float *ln2, float eps,
                        const void *w_qkv, const void *w_o, const void *w_gate_up, const void *w_down, int bf16,
                        const int32_t *threads, const float *bias_qkv, const int64_t *positions, const float *cos_t,
                        const float *sin_t, int64_t rope_rows, float *keys, float *values, int64_t cache_rows,
                        int64_t start, int64_t committed, const uint8_t *attend, int64_t H, int64_t KV, int64_t hd,
                        float *scratch) {
    int64_t width = (H + 2 * KV) * hd;
    float *h = scratch;                  /* [m, dim] */
    float *qkv = h + m * dim;            /* [m, width] */
    float *attn = qkv + m * width;       /* [m, H hd] */
    float *o = attn + m * H * hd;        /* [m, dim] */
    float *gu = o + m * dim;             /* [m, 2 inter] */
    float *a = gu + m * 2 * inter;       /* [m, inter] */
    float *r = a + m * inter;            /* [m, dim] */
    int status;

    ogspo_add_rmsnorm(x, 0, ln1, h, m, dim, eps);
    if ((status = gemm(h, m, dim, w_qkv, width, qkv, threads[0], bf16))) return status;
    status = ogspo_rope_attention(qkv, bias_qkv, positions, cos_t, sin_t, rope_rows, keys, values, cache_rows, start,
                                  committed, attend, m, H, KV, hd, attn, threads[4]);
    if (status) return status;
    if ((status = gemm(attn, m, H * hd, w_o, dim, o, threads[1], bf16))) return status;
    ogspo_add_rmsnorm(x, o, ln2, h, m, dim, eps);
    if ((status = gemm(h, m, dim, w_gate_up, 2 * inter, gu, threads[2], bf16))) return status;
    ogspo_silu_mul(gu, a, m, inter);
    if ((status = gemm(a, m, inter, w_down, dim, r, threads[3], bf16))) return status;
    for (int64_t i = 0; i < m * dim; i++) x[i] += r[i];
    return 0;
}
