/*
 * The decoder layers of a Llama-family model for a decode-only step on the CPU, float32, in one
 * native call: per layer RMSNorm (+ residual), the fused q/k/v projection, rotary embedding, K/V
 * written to the paged cache, paged attention, the output projection, RMSNorm (+ residual), the
 * fused gate/up projection, SiLU-and-mul and the down projection; then the final RMSNorm. Every
 * step is the same kernel the Python forward calls (this library's elementwise, attention and
 * panel-weight product kernels), in the same order, so the two paths give the same numbers; this
 * one saves the interpreter and dispatch cost of some three hundred calls per step.
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
                int64_t head_dim, const int64_t *positions, const float *cos_cache, const float *sin_cache);
int paged_decode_attention_f32(
    const float *q, int64_t q_stride_seq, int64_t q_stride_head, const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, float *out,
    int64_t out_stride_seq, int64_t out_stride_head, int64_t num_seqs, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_seq_len, float scale);
int panel_linear_f32(const float *x, int64_t ldx, const float *panels, const float *bias, float *out,
                     int64_t ldo, int64_t m, int64_t n, int64_t k);

/* Per-layer pointers, ``num_layers`` of each, in this order in ``layer_ptrs``. */
enum { P_LN1, P_QKV, P_QKV_BIAS, P_O, P_LN2, P_GATE_UP, P_DOWN, P_K_CACHE, P_V_CACHE, NUM_P };

/*
 * ``x`` [rows, hidden]: the embedded input tokens (overwritten). ``out`` [rows, hidden]: the final
 * hidden states (after ``final_norm``). Row r is one sequence's new token at ``positions[r]``, its K/V
 * go to cache slot ``slots[r]`` (skipped when negative) and it attends over ``seq_lens[r]`` tokens
 * through ``block_tables[r]``. Returns 0, or -1 when a scratch buffer could not be allocated.
 */
int llama_decode_layers_f32(
    int64_t num_layers, const void *const *layer_ptrs, const float *final_norm,
    float *x, float *out, int64_t rows, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t intermediate, float eps, float scale,
    const int64_t *positions, const float *cos_cache, const float *sin_cache, const int64_t *slots,
    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, int64_t max_seq_len,
    int64_t block_size)
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
        if (l == 0) { /* residual = x; h = norm(x) */
            memcpy(residual, x, sizeof(float) * (size_t)(rows * hidden));
            rms_norm_f32(x, hidden, NULL, 0, h, hidden, NULL, 0, ln1, rows, hidden, eps);
        } else { /* residual += x; h = norm(residual) */
            rms_norm_f32(x, hidden, residual, hidden, h, hidden, residual, hidden, ln1, rows, hidden, eps);
        }
        if ((rc = panel_linear_f32(h, hidden, PTR(P_QKV), PTR(P_QKV_BIAS), qkv, qkv_size, rows, qkv_size, hidden)))
            break;
        /* q and k heads are adjacent: rotate them in one pass. */
        rotary_f32(qkv, qkv_size, head_dim, rows, num_heads + num_kv_heads, head_dim, positions, cos_cache, sin_cache);
        for (int64_t r = 0; r < rows; ++r) {
            if (slots[r] < 0) continue;
            const float *k = qkv + r * qkv_size + q_size;
            memcpy(k_cache + slots[r] * kv_size, k, sizeof(float) * (size_t)kv_size);
            memcpy(v_cache + slots[r] * kv_size, k + kv_size, sizeof(float) * (size_t)kv_size);
        }
        rc = paged_decode_attention_f32(qkv, qkv_size, head_dim, k_cache, v_cache, block_tables, table_stride,
                                        seq_lens, attn, q_size, head_dim, rows, num_heads, num_kv_heads, head_dim,
                                        block_size, max_seq_len, scale);
        if (rc || (rc = panel_linear_f32(attn, q_size, PTR(P_O), NULL, x, hidden, rows, hidden, q_size)))
            break;
        rms_norm_f32(x, hidden, residual, hidden, h, hidden, residual, hidden, ln2, rows, hidden, eps);
        if ((rc = panel_linear_f32(h, hidden, PTR(P_GATE_UP), NULL, gate_up, 2 * intermediate, rows,
                                   2 * intermediate, hidden)))
            break;
        silu_and_mul_f32(gate_up, 2 * intermediate, act, intermediate, rows, intermediate);
        rc = panel_linear_f32(act, intermediate, PTR(P_DOWN), NULL, x, hidden, rows, hidden, intermediate);
#undef PTR
    }
    if (rc == 0) rms_norm_f32(x, hidden, residual, hidden, out, hidden, residual, hidden, final_norm, rows, hidden, eps);
    free(residual);
    free(h);
    free(qkv);
    free(attn);
    free(gate_up);
    free(act);
    return rc;
}
