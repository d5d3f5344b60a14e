/*
 * The decoder layers of a Llama-family model for a decode-only step on the CPU, float32, in one
 * native call: per layer RMSNorm (+ residual), the fused q/k/v projection, rotary embedding, K/V
 * written to the paged cache, paged attention, the output projection, RMSNorm (+ residual), the
 * fused gate/up projection, SiLU-and-mul and the down projection; then the final RMSNorm. Every
 * step is the same kernel the Python forward calls (this library's elementwise, attention, panel-weight
 * and quantized-weight product kernels), in the same order, so the two paths give the same numbers;
 * this one saves the interpreter and dispatch cost of some three hundred calls per step.
 *
 * A projection's weight is described by a linear_weight_t: one or more parts stacked along the
 * outputs (a fused q/k/v projection of a GGUF file whose q, k and v have different types has three),
 * each float32 panels (linear_cpu.c) or GGUF blocks of a quantized type (quant_cpu.c), and an
 * optional bias added after the products, as the Python layers add it.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The kernels of this library the layer loop calls (elementwise_cpu.c, paged_decode_cpu.c, linear_cpu.c). */
void rms_norm_f32(const float *x, int64_t x_stride, const float *residual, int64_t res_stride,
                  float *out, int64_t out_stride, float *res_out, int64_t res_out_stride,
                  const float *weight, int64_t rows, int64_t hidden, float eps);
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t out_stride, int64_t rows, int64_t d);
void rotary_f32(float *x, int64_t stride_t, int64_t stride_h, int64_t tokens, int64_t num_heads,
                int64_t head_dim, const int64_t *positions, const float *cos_cache, const float *sin_cache,
                int64_t interleaved);
int paged_decode_attention_f32(
    const float *q, int64_t q_stride_seq, int64_t q_stride_head, const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, float *out,
    int64_t out_stride_seq, int64_t out_stride_head, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_seq_len, float scale);
int panel_linear_f32(const float *x, int64_t ldx, const float *panels, const float *bias, float *out,
                     int64_t ldo, int64_t m, int64_t n, int64_t k);
int64_t quant_matmul_f32(int64_t type, const void *w, int64_t n, int64_t k, const float *x, int64_t m, int64_t ldx,
                         float *y, int64_t ldy);
int64_t amx_quant_matmul_f32(int64_t type, const void *w, int64_t n, int64_t k, const float *x, int64_t m,
                             int64_t ldx, float *y, int64_t ldy); /* quant_amx_cpu.c */

#define LINEAR_MAX_PARTS 4
#define LINEAR_PANELS 0 /* part type of float32 panels; other values are GGML type ids */

/* A projection's weight (kept in step with LinearWeightStruct in pagedllm/kernels/cpu/decode_layers.py). */
typedef struct {
    int64_t num_parts;
    int64_t type[LINEAR_MAX_PARTS];  /* LINEAR_PANELS or the GGML type of the part's blocks */
    int64_t rows[LINEAR_MAX_PARTS];  /* output rows of the part; parts are stacked in order */
    const void *data[LINEAR_MAX_PARTS];
    const float *bias;               /* [sum of rows], or NULL */
    int64_t amx_min_rows[LINEAR_MAX_PARTS]; /* products of at least this many rows on the AMX tiles (0: never) */
} linear_weight_t;

/* out[m, n] (row stride ldo) = x[m, k] @ W^T (+ bias). Returns 0 or a kernel's error code. */
static int linear_forward(const linear_weight_t *w, const float *x, int64_t ldx, float *out, int64_t ldo, int64_t m,
                          int64_t k)
{
    int64_t col = 0;
    for (int64_t p = 0; p < w->num_parts; ++p) {
        const int64_t rows = w->rows[p];
        int64_t rc = -4; /* (amx_quant_matmul_f32's "no AMX here") */
        if (w->type[p] != LINEAR_PANELS && w->amx_min_rows[p] > 0 && m >= w->amx_min_rows[p])
            rc = amx_quant_matmul_f32(w->type[p], w->data[p], rows, k, x, m, ldx, out + col, ldo);
        if (rc == -4)
            rc = w->type[p] == LINEAR_PANELS ? panel_linear_f32(x, ldx, w->data[p], NULL, out + col, ldo, m, rows, k)
                                             : quant_matmul_f32(w->type[p], w->data[p], rows, k, x, m, ldx, out + col, ldo);
        if (rc) return (int)rc;
        col += rows;
    }
    if (w->bias)
        for (int64_t r = 0; r < m; ++r)
            for (int64_t c = 0; c < col; ++c) out[r * ldo + c] += w->bias[c];
    return 0;
}

/* Per-layer pointers, ``num_layers`` of each, in this order in ``layer_ptrs`` (projections point to a
 * linear_weight_t). */
enum { P_LN1, P_QKV, P_O, P_LN2, P_GATE_UP, P_DOWN, P_K_CACHE, P_V_CACHE, NUM_P };

/*
 * ``x`` [rows, hidden]: the embedded input tokens (overwritten). ``out`` [rows, hidden]: the final
 * hidden states (after ``final_norm``). A pipeline stage runs a run of the layers: ``residual_in``
 * (NULL for the first stage) is the residual stream carried with ``x`` from the stage before, and with
 * ``final_norm`` NULL the layers' last ``x`` goes to ``out`` and the residual to ``residual_out``
 * (the next stage's input) instead of the final norm. Row r is one sequence's new token at ``positions[r]``, its K/V
 * go to cache slot ``slots[r]`` (skipped when negative) and it attends over ``seq_lens[r]`` tokens
 * through ``block_tables[r]``; ``rope_interleaved``: the rotary pairs' layout (see rotary_f32). Returns 0, -1 when a scratch buffer could not be allocated, or a
 * product kernel's error code.
 */
int llama_decode_layers_f32(
    int64_t num_layers, const void *const *layer_ptrs, const float *final_norm,
    float *x, const float *residual_in, float *out, float *residual_out, int64_t rows, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t intermediate, float eps, float scale,
    const int64_t *positions, const float *cos_cache, const float *sin_cache, const int64_t *slots,
    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, int64_t max_seq_len,
    int64_t block_size, int64_t rope_interleaved)
{
    const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size;
    float *residual = malloc(sizeof(float) * (size_t)(rows * hidden));
    float *h = malloc(sizeof(float) * (size_t)(rows * hidden));
    float *qkv = malloc(sizeof(float) * (size_t)(rows * qkv_size));
    float *attn = malloc(sizeof(float) * (size_t)(rows * q_size));
    float *gate_up = malloc(sizeof(float) * (size_t)(rows * 2 * intermediate));
    float *act = malloc(sizeof(float) * (size_t)(rows * intermediate));
    int rc = residual && h && qkv && attn && gate_up && act ? 0 : -1;
    for (int64_t l = 0; l < num_layers && rc == 0; ++l) {
#define PTR(i) layer_ptrs[(i) * num_layers + l]
        const float *ln1 = PTR(P_LN1), *ln2 = PTR(P_LN2);
        float *k_cache = (float *)PTR(P_K_CACHE), *v_cache = (float *)PTR(P_V_CACHE);
        if (l == 0 && residual_in) { /* residual = residual_in + x; h = norm(residual) */
            memcpy(residual, residual_in, sizeof(float) * (size_t)(rows * hidden));
            rms_norm_f32(x, hidden, residual, hidden, h, hidden, residual, hidden, ln1, rows, hidden, eps);
        } else if (l == 0) { /* residual = x; h = norm(x) */
            memcpy(residual, x, sizeof(float) * (size_t)(rows * hidden));
            rms_norm_f32(x, hidden, NULL, 0, h, hidden, NULL, 0, ln1, rows, hidden, eps);
        } else { /* residual += x; h = norm(residual) */
            rms_norm_f32(x, hidden, residual, hidden, h, hidden, residual, hidden, ln1, rows, hidden, eps);
        }
        if ((rc = linear_forward(PTR(P_QKV), h, hidden, qkv, qkv_size, rows, hidden))) break;
        /* q and k heads are adjacent: rotate them in one pass. */
        rotary_f32(qkv, qkv_size, head_dim, rows, num_heads + num_kv_heads, head_dim, positions, cos_cache, sin_cache,
                   rope_interleaved);
        for (int64_t r = 0; r < rows; ++r) {
            if (slots[r] < 0) continue;
            const float *k = qkv + r * qkv_size + q_size;
            memcpy(k_cache + slots[r] * kv_size, k, sizeof(float) * (size_t)kv_size);
            memcpy(v_cache + slots[r] * kv_size, k + kv_size, sizeof(float) * (size_t)kv_size);
        }
        rc = paged_decode_attention_f32(qkv, qkv_size, head_dim, k_cache, v_cache, block_tables, table_stride,
                                        seq_lens, attn, q_size, head_dim, rows, num_heads, num_kv_heads, head_dim,
                                        block_size, max_seq_len, scale);
        if (rc || (rc = linear_forward(PTR(P_O), attn, q_size, x, hidden, rows, q_size))) break;
        rms_norm_f32(x, hidden, residual, hidden, h, hidden, residual, hidden, ln2, rows, hidden, eps);
        if ((rc = linear_forward(PTR(P_GATE_UP), h, hidden, gate_up, 2 * intermediate, rows, hidden))) break;
        silu_and_mul_f32(gate_up, 2 * intermediate, act, intermediate, rows, intermediate);
        rc = linear_forward(PTR(P_DOWN), act, intermediate, x, hidden, rows, intermediate);
#undef PTR
    }
    if (rc == 0 && final_norm) {
        rms_norm_f32(x, hidden, residual, hidden, out, hidden, residual, hidden, final_norm, rows, hidden, eps);
    } else if (rc == 0) {
        memcpy(out, x, sizeof(float) * (size_t)(rows * hidden));
        memcpy(residual_out, residual, sizeof(float) * (size_t)(rows * hidden));
    }
    free(residual);
    free(h);
    free(qkv);
    free(attn);
    free(gate_up);
    free(act);
    return rc;
}
