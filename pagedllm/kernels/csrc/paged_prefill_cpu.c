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
 * is one query head at one position) share each loaded key and value vector, and each pass keeps
 * several vectors per row in registers (KEY_VECS score columns, VALUE_VECS output slices), so the
 * loads of one step feed enough independent multiply-adds. Scores are kept whole per row (exact
 * softmax in two passes, as in the decode kernel), then the values are summed with the softmax
 * weights. head_dim must be a multiple of 16.
 *
 * Sliding window (paged_prefill_attention_window_f32, window > 0): query token at position p sees
 * keys max(0, p - window + 1) .. p. A task copies keys from the start of the block holding its
 * first query's first key (``kbase``) on, so blocks before it are never read (a KV cache manager
 * may have released them); each row's scores before its own first key get weight 0. Soft-capping
 * (soft_cap > 0) maps each scaled score s to soft_cap * tanh(s / soft_cap) before the softmax.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

void softmax_row_f32(float *s, int64_t n); /* softmax_cpu.c */

typedef float v16 __attribute__((vector_size(64), aligned(4)));

#define QUERY_BLOCK 64 /* query tokens per task */
#define ROWS 6         /* query rows per pass over the keys */
#define KEY_VECS 2     /* 16-key columns of scores per pass over head_dim (ROWS x 2 accumulators) */
#define VALUE_VECS 4   /* 16-float slices of the output per pass over the keys (ROWS x 4 accumulators) */
#define MAX_VECS 16    /* head_dim / 16 at most (head_dim <= 256) */

/* Scores of the ROWS query rows ``qr`` against W * 16 keys: columns of ``kc`` (transposed keys,
 * row stride ldk), times ``scale``, into ``scores`` (row stride ldk). */
static inline __attribute__((always_inline)) void score_chunks(
    const int W, const float *const qr[ROWS], const float *kc, int64_t ldk, int64_t D, float scale, float *scores)
{
    v16 acc[ROWS][KEY_VECS];
    for (int r = 0; r < ROWS; ++r)
        for (int w = 0; w < W; ++w) acc[r][w] = (v16){0};
    for (int64_t d = 0; d < D; ++d) {
        v16 kv[KEY_VECS];
        for (int w = 0; w < W; ++w) kv[w] = *(const v16 *)(kc + d * ldk + 16 * w);
        for (int r = 0; r < ROWS; ++r) {
            const float a = qr[r][d];
            for (int w = 0; w < W; ++w) acc[r][w] += a * kv[w];
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int w = 0; w < W; ++w) *(v16 *)(scores + r * ldk + 16 * w) = acc[r][w] * scale;
}

/* dst[r][off : off + W * 16] = sum over keys j < nkeys of scores[r][j] * vs[j][0 : W * 16], for the
 * ROWS rows (``vs`` row stride D); rows repeated at the end of a pass: the last one's store wins. */
static inline __attribute__((always_inline)) void weigh_values(
    const int W, const float *scores, int64_t ldk, const float *vs, int64_t D, int64_t nkeys, float *const dst[ROWS],
    int64_t off)
{
    v16 o[ROWS][VALUE_VECS];
    for (int r = 0; r < ROWS; ++r)
        for (int w = 0; w < W; ++w) o[r][w] = (v16){0};
    for (int64_t j = 0; j < nkeys; ++j) {
        v16 vv[VALUE_VECS];
        for (int w = 0; w < W; ++w) vv[w] = *(const v16 *)(vs + j * D + 16 * w);
        for (int r = 0; r < ROWS; ++r) {
            const float p = scores[r * ldk + j];
            for (int w = 0; w < W; ++w) o[r][w] += p * vv[w];
        }
    }
    for (int r = ROWS - 1; r >= 0; --r)
        for (int w = 0; w < W; ++w) *(v16 *)(dst[r] + off + 16 * w) = o[r][w];
}

/* One task: query tokens [i0, i1) of a chunk, KV head g. ``kt`` [head_dim][ldk] and ``vs``
 * [ldk][head_dim] are scratch for the keys (transposed) and values it needs, ``scores`` [ROWS][ldk]. */
static void prefill_task(
    const float *q, int64_t q_stride_tok, int64_t q_stride_head, const float *k_cache, const float *v_cache,
    const int32_t *table, int64_t q_start, int64_t q_len, int64_t seq_len, int64_t i0, int64_t i1, int64_t g,
    float *out, int64_t out_stride_tok, int64_t out_stride_head, int64_t group, int64_t num_kv_heads,
    int64_t head_dim, int64_t block_size, float scale, float *kt, float *vs, int64_t ldk, float *scores,
    int64_t window, float soft_cap)
{
    const int64_t D = head_dim, NV = head_dim / 16, row_stride = num_kv_heads * head_dim;
    const int64_t context = seq_len - q_len; /* cached tokens before the chunk */
    /* First key of the first query token, and the start of its block: local key index 0. */
    const int64_t first_key = window > 0 && context + i0 + 1 > window ? context + i0 + 1 - window : 0;
    const int64_t kbase = first_key / block_size * block_size;
    const int64_t nkeys = context + i1 - kbase; /* local keys the last query token sees */
    const int64_t nkeys16 = (nkeys + 15) / 16 * 16;
    for (int64_t t0 = 0; t0 < nkeys; t0 += block_size) {
        const int64_t base = (int64_t)table[(kbase + t0) / block_size] * block_size * row_stride + g * D;
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
        float *dst[ROWS];
        int64_t nr[ROWS], lo[ROWS]; /* row r sees local keys lo[r] .. nr[r] - 1 */
        for (int r = 0; r < ROWS; ++r) {
            const int64_t f = f0 + r < last ? f0 + r : last - 1; /* past the end: repeat the last row */
            const int64_t i = f / group, h = g * group + f % group;
            qr[r] = q + (q_start + i) * q_stride_tok + h * q_stride_head;
            dst[r] = out + (q_start + i) * out_stride_tok + h * out_stride_head;
            nr[r] = context + i + 1 - kbase;
            lo[r] = window > 0 && context + i + 1 > window ? context + i + 1 - window - kbase : 0;
        }
        const int64_t nmax = nr[ROWS - 1], chunks = (nmax + 15) / 16;
        int64_t c = 0;
        for (; c + KEY_VECS <= chunks; c += KEY_VECS) score_chunks(KEY_VECS, qr, kt + c * 16, ldk, D, scale, scores + c * 16);
        for (; c < chunks; ++c) score_chunks(1, qr, kt + c * 16, ldk, D, scale, scores + c * 16);
        /* Softmax weights of each row over its own keys, zero for the keys before and after them. */
        for (int r = 0; r < ROWS; ++r) {
            float *sr = scores + r * ldk;
            if (soft_cap > 0.0f) {
                const float inv = 1.0f / soft_cap;
                for (int64_t j = lo[r]; j < nr[r]; ++j) sr[j] = soft_cap * tanhf(sr[j] * inv);
            }
            softmax_row_f32(sr + lo[r], nr[r] - lo[r]);
            for (int64_t j = 0; j < lo[r]; ++j) sr[j] = 0.0f;
            for (int64_t j = nr[r]; j < nmax; ++j) sr[j] = 0.0f;
        }
        int64_t v = 0;
        for (; v + VALUE_VECS <= NV; v += VALUE_VECS) weigh_values(VALUE_VECS, scores, ldk, vs + 16 * v, D, nmax, dst, 16 * v);
        for (; v < NV; ++v) weigh_values(1, scores, ldk, vs + 16 * v, D, nmax, dst, 16 * v);
    }
}

/* Returns 0; -1 when a scratch buffer could not be allocated, -2 when head_dim is not a multiple of
 * 16 (or over 256). ``window`` <= 0: no window; ``soft_cap`` <= 0: no soft-capping. */
int paged_prefill_attention_window_f32(
    const float *q, int64_t q_stride_tok, int64_t q_stride_head, const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t table_stride, const int64_t *chunks, float *out, int64_t out_stride_tok,
    int64_t out_stride_head,
    int64_t num_chunks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
    int64_t window, float soft_cap)
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
                         num_kv_heads, head_dim, block_size, scale, kt, vs, ldk, scores, window, soft_cap);
        }
        free(kt);
        free(vs);
        free(scores);
    }
    free(task_start);
    return failed ? -1 : 0;
}

/* Full causal attention without soft-capping. */
int paged_prefill_attention_f32(
    const float *q, int64_t q_stride_tok, int64_t q_stride_head, const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t table_stride, const int64_t *chunks, float *out, int64_t out_stride_tok,
    int64_t out_stride_head,
    int64_t num_chunks, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale)
{
    return paged_prefill_attention_window_f32(q, q_stride_tok, q_stride_head, k_cache, v_cache, block_tables,
                                              table_stride, chunks, out, out_stride_tok, out_stride_head, num_chunks,
                                              num_heads, num_kv_heads, head_dim, block_size, scale, 0, 0.0f);
}
