/*
 * Paged prefill attention on the CPU, float32: the query tokens of prompt chunks (causal, any
 * number of tokens of cached context before them) attend over K/V read in place from the
 * block-paged cache, every chunk of the batch in one call.
 *
 * Cache layout as in paged_decode_cpu.c: [num_blocks, block_size, num_kv_heads, head_dim]. Chunk c
 * is row c of ``chunks`` [num_chunks][4]: its block table row, its first row in q/out, its query
 * length and its sequence length. Its query tokens are the last ones of the sequence, whose K/V
 * are already in the cache; query token i (0-based in the chunk) sits at position
 * seq_len - q_len + i and attends to keys 0..that position.
 *
 * A task is one chunk, one KV head and up to QUERY_BLOCK query tokens. It first copies the keys it
 * needs, transposed ([head_dim][keys]), and the values, contiguous, into scratch buffers: 16 keys'
 * scores for one query are then head_dim vector multiply-adds with no horizontal sums, and the
 * blocks' scattered rows are resolved once per task rather than per query. ROWS query rows (a row
 * is one query head at one position) share each loaded key and value vector. Scores are kept whole
 * per row (exact softmax in two passes, as in the decode kernel), then the values are summed with
 * the softmax weights. head_dim must be a multiple of 16.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void softmax_row_f32(float *s, int64_t n); /* paged_decode_cpu.c */

typedef float v16 __attribute__((vector_size(64), aligned(4)));

#define QUERY_BLOCK 64 /* query tokens per task */
#define ROWS 6 /* query rows per pass over the keys */
#define MAX_VECS 16    /* head_dim / 16 at most (head_dim <= 256) */

/* One task: query tokens [i0, i1) of a chunk, KV head g. ``kt`` [head_dim][ldk] and ``vs``
 * [ldk][head_dim] are scratch for the keys (transposed) and values it needs, ``scores`` [ROWS][ldk]. */
static void prefill_task(
    const float *q, int64_t q_stride_tok, int64_t q_stride_head, const float *k_cache, const float *v_cache,
    const int32_t *table, int64_t q_start, int64_t q_len, int64_t seq_len, int64_t i0, int64_t i1, int64_t g,
    float *out, int64_t out_stride_tok, int64_t out_stride_head, int64_t group, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, float *kt, float *vs, int64_t ldk, float *scores)
{
    const int64_t D = head_dim, NV = head_dim / 16, row_stride = num_kv_heads * head_dim;
    const int64_t context = seq_len - q_len; /* cached tokens before the chunk */
    const int64_t nkeys = context + i1;      /* keys the last query token sees */
    const int64_t nkeys16 = (nkeys + 15) / 16 * 16;
    for (int64_t t0 = 0; t0 < nkeys; t0 += block_size) {
        const int64_t base = (int64_t)table[t0 / block_size] * block_size * row_stride + g * D;
        const int64_t n = nkeys - t0 < block_size ? nkeys - t0 : block_size;
        for (int64_t t = 0; t < n; ++t) {
            const float *k = k_cache + base + t * row_stride;
            for (int64_t d = 0; d < D; ++d) kt[d * ldk + t0 + t] = k[d];
            memcpy(vs + (t0 + t) * D, v_cache + base + t * row_stride, sizeof(float) * (size_t)D);
        }
    }
    for (int64_t d = 0; d < D; ++d)
        for (int64_t t = nkeys; t < nkeys16; ++t) kt[d * ldk + t] = 0.0f;

    const int64_t first = i0 * group, last = i1 * group; /* rows: position-major, then head */
    for (int64_t f0 = first; f0 < last; f0 += ROWS) {
        const float *qr[ROWS];
        int64_t nr[ROWS]; /* keys row r sees */
        for (int r = 0; r < ROWS; ++r) {
            const int64_t f = f0 + r < last ? f0 + r : last - 1; /* past the end: repeat the last row */
            const int64_t i = f / group, h = g * group + f % group;
            qr[r] = q + (q_start + i) * q_stride_tok + h * q_stride_head;
            nr[r] = context + i + 1;
        }
        const int64_t nmax = nr[ROWS - 1], chunks = (nmax + 15) / 16;
        for (int64_t c = 0; c < chunks; ++c) {
            v16 acc[ROWS];
            for (int r = 0; r < ROWS; ++r) acc[r] = (v16){0};
            const float *kc = kt + c * 16;
            for (int64_t d = 0; d < D; ++d) {
                const v16 kv = *(const v16 *)(kc + d * ldk);
                for (int r = 0; r < ROWS; ++r) acc[r] += qr[r][d] * kv;
            }
            for (int r = 0; r < ROWS; ++r) *(v16 *)(scores + r * ldk + c * 16) = acc[r] * scale;
        }
        /* Softmax weights of each row over its own keys, zero for the keys after them. */
        for (int r = 0; r < ROWS; ++r) {
            float *sr = scores + r * ldk;
            softmax_row_f32(sr, nr[r]);
            for (int64_t j = nr[r]; j < nmax; ++j) sr[j] = 0.0f;
        }
        float *dst[ROWS];
        for (int r = 0; r < ROWS; ++r) {
            const int64_t f = f0 + r < last ? f0 + r : last - 1, i = f / group, h = g * group + f % group;
            dst[r] = out + (q_start + i) * out_stride_tok + h * out_stride_head;
        }
        for (int64_t v = 0; v < NV; ++v) { /* 16 output dims of the ROWS rows at a time */
            v16 o[ROWS];
            for (int r = 0; r < ROWS; ++r) o[r] = (v16){0};
            for (int64_t j = 0; j < nmax; ++j) {
                const v16 vv = *(const v16 *)(vs + j * D + 16 * v);
                for (int r = 0; r < ROWS; ++r) o[r] += scores[r * ldk + j] * vv;
            }
            for (int r = ROWS - 1; r >= 0; --r) *(v16 *)(dst[r] + 16 * v) = o[r]; /* repeated rows: last wins */
        }
    }
}

/* Returns 0; -1 when a scratch buffer could not be allocated, -2 when head_dim is not a multiple of
 * 16 (or over 256). */
int paged_prefill_attention_f32(
    const float *q, int64_t q_stride_tok, int64_t q_stride_head, const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t table_stride, const int64_t *chunks, float *out, int64_t out_stride_tok,
    int64_t out_stride_head,
    int64_t num_chunks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale)
{
    if (head_dim % 16 != 0 || head_dim / 16 > MAX_VECS) return -2;
#define TABLE_ROW(c) chunks[4 * (c)]
#define Q_START(c) chunks[4 * (c) + 1]
#define Q_LEN(c) chunks[4 * (c) + 2]
#define SEQ_LEN(c) chunks[4 * (c) + 3]
    const int64_t group = num_heads / num_kv_heads;
    int64_t *task_start = malloc(sizeof(int64_t) * (size_t)(num_chunks + 1));
    if (task_start == NULL) return -1;
    int64_t max_len = 1;
    task_start[0] = 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
        task_start[c + 1] = task_start[c] + num_kv_heads * ((Q_LEN(c) + QUERY_BLOCK - 1) / QUERY_BLOCK);
        max_len = SEQ_LEN(c) > max_len ? SEQ_LEN(c) : max_len;
    }
    const int64_t ntasks = task_start[num_chunks];
    /* Rows of the scratch buffers: one vector past the longest sequence, so that a power-of-two
     * length does not map every row of a key column to the same few L1 cache sets. */
    const int64_t ldk = (max_len + 15) / 16 * 16 + 16;
    int failed = 0;
#pragma omp parallel if (ntasks > 1)
    {
        float *kt = aligned_alloc(64, sizeof(float) * (size_t)(head_dim * ldk));
        float *vs = aligned_alloc(64, sizeof(float) * (size_t)(head_dim * ldk));
        float *scores = aligned_alloc(64, sizeof(float) * (size_t)(ROWS * ldk));
        if (kt == NULL || vs == NULL || scores == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        int64_t c = 0;
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < ntasks; ++task) {
            if (kt == NULL || vs == NULL || scores == NULL) continue;
            while (task_start[c + 1] <= task) ++c; /* tasks come in increasing order per thread */
            while (task_start[c] > task) --c;
            const int64_t local = task - task_start[c];
            const int64_t g = local % num_kv_heads, qb = local / num_kv_heads;
            const int64_t i0 = qb * QUERY_BLOCK, i1 = i0 + QUERY_BLOCK < Q_LEN(c) ? i0 + QUERY_BLOCK : Q_LEN(c);
            prefill_task(q, q_stride_tok, q_stride_head, k_cache, v_cache, block_tables + TABLE_ROW(c) * table_stride,
                         Q_START(c), Q_LEN(c), SEQ_LEN(c), i0, i1, g, out, out_stride_tok, out_stride_head, group,
                         num_kv_heads, head_dim, block_size, scale, kt, vs, ldk, scores);
        }
        free(kt);
        free(vs);
        free(scores);
    }
    free(task_start);
    return failed ? -1 : 0;
}
