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
    /* LoRA adapter slots (lora_a NULL: none). Slot s holds A [in, lora_k] (in-major) at
     * lora_a + s * in * lora_k and B [lora_k, out] at lora_b + s * lora_k * out; lora_ranks[s] is its
     * adapter's rank here (0: the slot adds nothing), sub-projection i (lora_num_subs of them,
     * lora_sub_rows[i] outputs each, stacked) owning ranks [i * rank, (i + 1) * rank) and only its own
     * outputs. Everything else in a slot is zero and is not read. */
    const float *lora_a;
    const float *lora_b;
    int64_t lora_k;
    const int64_t *lora_ranks;
    int64_t lora_num_subs;
    int64_t lora_sub_rows[LINEAR_MAX_PARTS];
} linear_weight_t;

/* Which decode rows run which adapter slot: segment s is rows order[start[s] .. start[s] + len[s]) of
 * slot slot[s] (kept in step with LoRAPlan in pagedllm/kernels/cpu/decode_layers.py). */
typedef struct {
    int64_t num_segs;
    const int64_t *order;
    const int64_t *start;
    const int64_t *len;
    const int64_t *slot;
} lora_plan_t;

typedef float lv16 __attribute__((vector_size(64), aligned(4)));
#define LORA_RB 8 /* rows per block: their products share each load of A and B */

/* t[r][0:kk] = x[rows[r]] @ a[:, 0:kk] for LORA_RB rows (a: [k_in, ld_a]); the accumulators of a
 * 48-wide chunk of ranks for every row stay in registers over the whole input. */
static void lora_shrink_block(const float *x, int64_t ldx, const int64_t *rows, const float *a, int64_t ld_a,
                              int64_t k_in, int64_t kk, float *t)
{
    int64_t c0 = 0;
    for (; c0 + 48 <= kk; c0 += 48) {
        lv16 acc[LORA_RB][3];
        memset(acc, 0, sizeof acc);
        for (int64_t i = 0; i < k_in; ++i) {
            const float *ai = a + i * ld_a + c0;
            const lv16 a0 = *(const lv16 *)ai, a1 = *(const lv16 *)(ai + 16), a2 = *(const lv16 *)(ai + 32);
            for (int r = 0; r < LORA_RB; ++r) {
                const float xv = x[rows[r] * ldx + i];
                acc[r][0] += xv * a0;
                acc[r][1] += xv * a1;
                acc[r][2] += xv * a2;
            }
        }
        for (int r = 0; r < LORA_RB; ++r) memcpy(t + r * kk + c0, acc[r], sizeof acc[r]);
    }
    for (; c0 + 16 <= kk; c0 += 16) {
        lv16 acc[LORA_RB];
        memset(acc, 0, sizeof acc);
        for (int64_t i = 0; i < k_in; ++i) {
            const lv16 av = *(const lv16 *)(a + i * ld_a + c0);
            for (int r = 0; r < LORA_RB; ++r) acc[r] += x[rows[r] * ldx + i] * av;
        }
        for (int r = 0; r < LORA_RB; ++r) memcpy(t + r * kk + c0, &acc[r], sizeof acc[r]);
    }
    for (; c0 < kk; ++c0)
        for (int r = 0; r < LORA_RB; ++r) {
            float sum = 0.0f;
            for (int64_t i = 0; i < k_in; ++i) sum += x[rows[r] * ldx + i] * a[i * ld_a + c0];
            t[r * kk + c0] = sum;
        }
}

/* out[rows[r]][cols] += t[r][ranks] @ b[ranks, cols] for the first ``nr`` of LORA_RB rows (b:
 * [.., ld_b]); 32 columns of every row accumulate in registers over the ranks. */
static void lora_expand_block(float *out, int64_t ldo, const int64_t *rows, int nr, const float *t, int64_t kk,
                              const float *b, int64_t ld_b, int64_t c_lo, int64_t c_hi, int64_t col_lo, int64_t col_hi)
{
    int64_t col = col_lo;
    for (; col + 32 <= col_hi; col += 32) {
        lv16 acc[LORA_RB][2];
        for (int r = 0; r < LORA_RB; ++r) memcpy(acc[r], out + rows[r] * ldo + col, sizeof acc[r]);
        for (int64_t c = c_lo; c < c_hi; ++c) {
            const float *bc = b + c * ld_b + col;
            const lv16 b0 = *(const lv16 *)bc, b1 = *(const lv16 *)(bc + 16);
            for (int r = 0; r < LORA_RB; ++r) {
                const float tv = t[r * kk + c];
                acc[r][0] += tv * b0;
                acc[r][1] += tv * b1;
            }
        }
        for (int r = 0; r < nr; ++r) memcpy(out + rows[r] * ldo + col, acc[r], sizeof acc[r]);
    }
    for (; col < col_hi; ++col)
        for (int r = 0; r < nr; ++r) {
            float sum = 0.0f;
            for (int64_t c = c_lo; c < c_hi; ++c) sum += t[r * kk + c] * b[c * ld_b + col];
            out[rows[r] * ldo + col] += sum;
        }
}

/* out[row] += (x[row] @ A) @ B for the rows of each segment, with its slot's pairs of ``w``: blocks of
 * LORA_RB rows of one segment, spread over the threads. */
static int lora_add(const linear_weight_t *w, const lora_plan_t *plan, const float *x, int64_t ldx, float *out,
                    int64_t ldo, int64_t k_in)
{
    if (!plan || !w->lora_a || plan->num_segs == 0) return 0;
    int64_t out_total = 0, blocks = 0;
    for (int64_t i = 0; i < w->lora_num_subs; ++i) out_total += w->lora_sub_rows[i];
    int64_t first_block[64 + 1];
    if (plan->num_segs > 64) return -2;
    for (int64_t sg = 0; sg < plan->num_segs; ++sg) {
        first_block[sg] = blocks;
        blocks += (plan->len[sg] + LORA_RB - 1) / LORA_RB;
    }
    first_block[plan->num_segs] = blocks;
    const int64_t ld_a = w->lora_k;
#pragma omp parallel for schedule(static) if (blocks > 1)
    for (int64_t blk = 0; blk < blocks; ++blk) {
        int64_t sg = 0;
        while (first_block[sg + 1] <= blk) ++sg;
        const int64_t slot = plan->slot[sg], rank = w->lora_ranks[slot];
        if (rank == 0) continue;
        const int64_t kk = w->lora_num_subs * rank;
        const int64_t r0 = (blk - first_block[sg]) * LORA_RB;
        const int64_t left = plan->len[sg] - r0;
        const int nr = (int)(left < LORA_RB ? left : LORA_RB);
        int64_t rows[LORA_RB];
        for (int r = 0; r < LORA_RB; ++r) rows[r] = plan->order[plan->start[sg] + r0 + (r < nr ? r : nr - 1)];
        float t[LORA_RB * 4 * 256]; /* kk <= LINEAR_MAX_PARTS * 256 (max_lora_rank <= 256) */
        const float *a = w->lora_a + slot * k_in * ld_a;
        const float *b = w->lora_b + slot * ld_a * out_total;
        lora_shrink_block(x, ldx, rows, a, ld_a, k_in, kk, t);
        int64_t col = 0;
        for (int64_t sub = 0; sub < w->lora_num_subs; ++sub) {
            lora_expand_block(out, ldo, rows, nr, t, kk, b, out_total, sub * rank, (sub + 1) * rank, col,
                              col + w->lora_sub_rows[sub]);
            col += w->lora_sub_rows[sub];
        }
    }
    return 0;
}

/* out[m, n] (row stride ldo) = x[m, k] @ W^T (+ bias) (+ each row's adapter product, with ``plan``).
 * Returns 0 or a kernel's error code. */
static int linear_forward(const linear_weight_t *w, const float *x, int64_t ldx, float *out, int64_t ldo, int64_t m,
                          int64_t k, const lora_plan_t *plan)
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
    return lora_add(w, plan, x, ldx, out, ldo, k);
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
 * through ``block_tables[r]``; ``rope_interleaved``: the rotary pairs' layout (see rotary_f32); ``lora``
 * (NULL: none) the rows' adapter slots, added to every projection that has slots. Returns 0, -1 when a
 * scratch buffer could not be allocated, -2 for a LoRA plan of more than 64 segments, or a product
 * kernel's error code.
 */
int llama_decode_layers_f32(
    int64_t num_layers, const void *const *layer_ptrs, const float *final_norm,
    float *x, const float *residual_in, float *out, float *residual_out, int64_t rows, int64_t hidden, int64_t num_heads, int64_t num_kv_heads,
    int64_t head_dim, int64_t intermediate, float eps, float scale,
    const int64_t *positions, const float *cos_cache, const float *sin_cache, const int64_t *slots,
    const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, int64_t max_seq_len,
    int64_t block_size, int64_t rope_interleaved, const lora_plan_t *lora)
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
        if ((rc = linear_forward(PTR(P_QKV), h, hidden, qkv, qkv_size, rows, hidden, lora))) break;
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
        if (rc || (rc = linear_forward(PTR(P_O), attn, q_size, x, hidden, rows, q_size, lora))) break;
        rms_norm_f32(x, hidden, residual, hidden, h, hidden, residual, hidden, ln2, rows, hidden, eps);
        if ((rc = linear_forward(PTR(P_GATE_UP), h, hidden, gate_up, 2 * intermediate, rows, hidden, lora))) break;
        silu_and_mul_f32(gate_up, 2 * intermediate, act, intermediate, rows, intermediate);
        rc = linear_forward(PTR(P_DOWN), act, intermediate, x, hidden, rows, intermediate, lora);
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
