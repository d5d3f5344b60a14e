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
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

float exp_shifted_f32(float *s, int64_t n, int64_t a, int64_t b, float m); /* softmax_cpu.c */

typedef float v16 __attribute__((vector_size(64), aligned(4)));

#define QUERY_BLOCK 64 /* query tokens per task */
#define ROWS 6         /* query rows per pass over the keys */
#define KEY_VECS 2     /* 16-key columns of scores per pass over head_dim (ROWS x 2 accumulators) */
#define VALUE_VECS 4   /* 16-float slices of the output per pass over the keys (ROWS x 4 accumulators) */
#define MAX_VECS 16    /* head_dim / 16 at most (head_dim <= 256) */
#define KEY_TILE 256   /* keys per tile of the online softmax: keys and values stay in L2 */
#define SPAN 2048      /* keys per task at most: longer contexts are split at multiples of SPAN and merged */
#define KT_LD (KEY_TILE + 16) /* row stride of the transposed keys and the scores (off power-of-two sets) */

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

/* acc[r][off : off + W * 16] = corr[r] * acc[r][...] + sum over keys j < nkeys of p[r][j] * vs[j][...]
 * for the ROWS rows (``p`` row stride ldp, ``vs`` row stride D, ``acc`` rows of D floats). */
static inline __attribute__((always_inline)) void weigh_values(
    const int W, const float *p, int64_t ldp, const float *vs, int64_t D, int64_t nkeys, float *const acc[ROWS],
    const float corr[ROWS], int64_t off)
{
    v16 o[ROWS][VALUE_VECS];
    for (int r = 0; r < ROWS; ++r)
        for (int w = 0; w < W; ++w) o[r][w] = *(const v16 *)(acc[r] + off + 16 * w) * corr[r];
    for (int64_t j = 0; j < nkeys; ++j) {
        v16 vv[VALUE_VECS];
        for (int w = 0; w < W; ++w) vv[w] = *(const v16 *)(vs + j * D + 16 * w);
        for (int r = 0; r < ROWS; ++r) {
            const float pr = p[r * ldp + j];
            for (int w = 0; w < W; ++w) o[r][w] += pr * vv[w];
        }
    }
    for (int r = 0; r < ROWS; ++r)
        for (int w = 0; w < W; ++w) *(v16 *)(acc[r] + off + 16 * w) = o[r][w];
}

/* Keys at positions [pos0, pos0 + n) of a sequence copied from its paged cache: keys transposed into
 * ``kt`` (column t for position pos0 + t, row stride KT_LD) and values into ``vt`` (row t). */
static void copy_keys(
    const float *k_cache, const float *v_cache, const int32_t *table, int64_t pos0, int64_t n, int64_t g,
    int64_t D, int64_t block_size, int64_t row_stride, float *kt, float *vt)
{
    for (int64_t done = 0; done < n;) {
        const int64_t pos = pos0 + done, in_block = pos % block_size;
        const int64_t run = block_size - in_block < n - done ? block_size - in_block : n - done;
        const int64_t base = ((int64_t)table[pos / block_size] * block_size + in_block) * row_stride + g * D;
        /* Keys transposed 16 at a time: each pass over head_dim stores whole vectors of 16 keys. */
        for (int64_t s0 = 0; s0 < run; s0 += 16) {
            const int64_t m = run - s0 < 16 ? run - s0 : 16;
            const float *k = k_cache + base + s0 * row_stride;
            float *dst = kt + done + s0;
            if (m == 16) {
                for (int64_t d = 0; d < D; ++d) {
                    v16 col;
                    for (int t = 0; t < 16; ++t) col[t] = k[t * row_stride + d];
                    *(v16 *)(dst + d * KT_LD) = col;
                }
            } else {
                for (int64_t d = 0; d < D; ++d)
                    for (int64_t t = 0; t < m; ++t) dst[d * KT_LD + t] = k[t * row_stride + d];
            }
        }
        for (int64_t t = 0; t < run; ++t)
            memcpy(vt + (done + t) * D, v_cache + base + t * row_stride, sizeof(float) * (size_t)D);
        done += run;
    }
}

/* Columns [from, to) of the transposed keys and rows [from, to) of the values set to 0. */
static void zero_keys(float *kt, float *vt, int64_t D, int64_t from, int64_t to)
{
    for (int64_t d = 0; d < D; ++d)
        for (int64_t t = from; t < to; ++t) kt[d * KT_LD + t] = 0.0f;
    if (to > from) memset(vt + from * D, 0, sizeof(float) * (size_t)((to - from) * D));
}

/* Per-thread scratch, kept between calls and grown when a call needs more: fresh pages for every
 * layer of every step (faulted in and zeroed by the kernel) would cost more than the work. */
static _Thread_local float *scratch = NULL;
static _Thread_local size_t scratch_floats = 0;

static int scratch_reserve(size_t floats)
{
    if (floats <= scratch_floats) return 1;
    free(scratch);
    scratch = aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    scratch_floats = scratch == NULL ? 0 : floats;
    return scratch != NULL;
}

/* Scratch floats of one thread: the tile's keys and values, one pass's scores, and the running
 * output, maximum and sum of up to ``slots`` rows. */
static size_t task_scratch_floats(int64_t head_dim, int64_t slots)
{
    return (size_t)(head_dim * KT_LD + KEY_TILE * head_dim + ROWS * KT_LD + slots * (head_dim + 2));
}

/* The first key of query token i0 of a chunk with ``context`` cached tokens, rounded down to its
 * block: no key before it is read (a KV cache manager may have released the blocks out of the window). */
static int64_t first_block_key(int64_t context, int64_t i0, int64_t window, int64_t block_size)
{
    const int64_t first_key = window > 0 && context + i0 + 1 > window ? context + i0 + 1 - window : 0;
    return first_key / block_size * block_size;
}

/* One task: query tokens [i0, i1) of a chunk, KV head g, over the keys at positions [span_lo,
 * span_hi), with the online softmax over tiles of KEY_TILE keys at fixed positions (multiples of
 * KEY_TILE): each tile is copied once (its keys transposed) and every row of the task attends to it
 * while it is in the core's cache, keeping a running maximum, sum and output per row. With ``part``
 * NULL the task covers all of its rows' keys and writes their outputs; otherwise it writes, per row
 * slot, the unnormalised output, the maximum and the sum to ``part`` ([slots][D], [slots], [slots])
 * for :func:`merge_spans`. A row's result depends only on its query, its keys and these fixed
 * positions, so it is computed alike whatever chunk, query block, step or thread count it falls in. */
static void prefill_task(
    const float *q, int64_t q_stride_tok, int64_t q_stride_head, const float *k_cache, const float *v_cache,
    const int32_t *table, int64_t q_start, int64_t q_len, int64_t seq_len, int64_t i0, int64_t i1, int64_t g,
    int64_t span_lo, int64_t span_hi, float *out, int64_t out_stride_tok, int64_t out_stride_head, float *part,
    int64_t group, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float *scratch,
    int64_t window, float soft_cap)
{
    const int64_t D = head_dim, NV = head_dim / 16, row_stride = num_kv_heads * head_dim;
    const int64_t context = seq_len - q_len; /* cached tokens before the chunk */
    const int64_t kbase = first_block_key(context, i0, window, block_size);
    const int64_t end = context + i1 < span_hi ? context + i1 : span_hi; /* past the last key read */
    const int64_t first = i0 * group, last = i1 * group; /* rows: position-major, then head */
    const int64_t slots = (last - first + ROWS - 1) / ROWS * ROWS;
    float *kt = scratch, *vt = kt + D * KT_LD, *scores = vt + KEY_TILE * D;
    float *acc = part != NULL ? part : scores + ROWS * KT_LD;
    float *run_max = acc + slots * D, *run_sum = run_max + slots;
    for (int64_t r = 0; r < slots; ++r) {
        run_max[r] = -FLT_MAX; /* no key seen yet: the first tile's correction is 0 */
        run_sum[r] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(slots * D));

    const int64_t lo = kbase > span_lo ? kbase : span_lo;
    for (int64_t t0 = lo / KEY_TILE * KEY_TILE; t0 < end; t0 += KEY_TILE) {
        /* This tile's keys read: positions [from, to); columns before ``from`` are zeros. */
        const int64_t from = lo > t0 ? lo : t0, to = end < t0 + KEY_TILE ? end : t0 + KEY_TILE;
        zero_keys(kt, vt, D, 0, from - t0);
        copy_keys(k_cache, v_cache, table, from, to - from, g, D, block_size, row_stride, kt + (from - t0),
                  vt + (from - t0) * D);
        zero_keys(kt, vt, D, to - t0, (to - t0 + 15) / 16 * 16);
        for (int64_t f0 = first; f0 < last; f0 += ROWS) {
            const float *qr[ROWS];
            float *rows_acc[ROWS];
            float corr[ROWS];
            int64_t a[ROWS], b[ROWS]; /* row r sees this tile's columns a[r] .. b[r] - 1 */
            int64_t bmax = 0;
            for (int r = 0; r < ROWS; ++r) {
                const int64_t f = f0 + r < last ? f0 + r : last - 1; /* past the end: repeat the last row */
                const int64_t i = f / group, h = g * group + f % group, pos = context + i;
                qr[r] = q + (q_start + i) * q_stride_tok + h * q_stride_head;
                rows_acc[r] = acc + (f0 - first + r) * D; /* a slot of its own, even when repeated */
                const int64_t row_lo = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
                const int64_t row_from = row_lo > from ? row_lo : from;
                const int64_t row_to = pos + 1 < to ? pos + 1 : to;
                a[r] = row_to > row_from ? row_from - t0 : 0; /* none: a = b = 0 */
                b[r] = row_to > row_from ? row_to - t0 : 0;
                if (b[r] > bmax) bmax = b[r]; /* at most the tile's length */
            }
            if (bmax <= 0) continue;
            const int64_t chunks = (bmax + 15) / 16;
            int64_t c = 0;
            for (; c + KEY_VECS <= chunks; c += KEY_VECS)
                score_chunks(KEY_VECS, qr, kt + c * 16, KT_LD, D, scale, scores + c * 16);
            for (; c < chunks; ++c) score_chunks(1, qr, kt + c * 16, KT_LD, D, scale, scores + c * 16);
            for (int r = 0; r < ROWS; ++r) {
                float *sr = scores + r * KT_LD;
                const int64_t slot = f0 - first + r;
                if (b[r] <= a[r]) { /* no key of this tile: weights 0, running values unchanged */
                    memset(sr, 0, sizeof(float) * (size_t)(chunks * 16));
                    corr[r] = 1.0f;
                    continue;
                }
                if (soft_cap > 0.0f) {
                    const float inv = 1.0f / soft_cap;
                    for (int64_t j = a[r]; j < b[r]; ++j) sr[j] = soft_cap * tanhf(sr[j] * inv);
                }
                float m = sr[a[r]];
                for (int64_t j = a[r] + 1; j < b[r]; ++j) m = sr[j] > m ? sr[j] : m;
                const float m_old = run_max[slot], m_new = m > m_old ? m : m_old;
                corr[r] = m_old == -FLT_MAX ? 0.0f : expf(m_old - m_new);
                run_sum[slot] = run_sum[slot] * corr[r] + exp_shifted_f32(sr, chunks * 16, a[r], b[r], m_new);
                run_max[slot] = m_new;
            }
            int64_t v = 0;
            for (; v + VALUE_VECS <= NV; v += VALUE_VECS)
                weigh_values(VALUE_VECS, scores, KT_LD, vt + 16 * v, D, bmax, rows_acc, corr, 16 * v);
            for (; v < NV; ++v) weigh_values(1, scores, KT_LD, vt + 16 * v, D, bmax, rows_acc, corr, 16 * v);
        }
    }
    if (part != NULL) return;
    for (int64_t f = first; f < last; ++f) {
        const int64_t i = f / group, h = g * group + f % group;
        float *dst = out + (q_start + i) * out_stride_tok + h * out_stride_head;
        const float *src = acc + (f - first) * D;
        const float inv = 1.0f / run_sum[f - first];
        for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * inv;
    }
}

/* The outputs of query tokens [i0, i1) of a chunk, KV head g, from the partial results of its
 * ``nspans`` spans (laid out one after another from ``part``, each as :func:`prefill_task` writes
 * them), in span order: a span whose keys a row does not see has maximum -FLT_MAX and weighs 0. */
static void merge_spans(
    const float *part, int64_t nspans, int64_t q_start, int64_t i0, int64_t i1, int64_t g, float *out,
    int64_t out_stride_tok, int64_t out_stride_head, int64_t group, int64_t D)
{
    const int64_t first = i0 * group, last = i1 * group;
    const int64_t slots = (last - first + ROWS - 1) / ROWS * ROWS, stride = slots * (D + 2);
    for (int64_t f = first; f < last; ++f) {
        const int64_t slot = f - first, i = f / group, h = g * group + f % group;
        float m = -FLT_MAX;
        for (int64_t sp = 0; sp < nspans; ++sp) {
            const float ms = part[sp * stride + slots * D + slot];
            m = ms > m ? ms : m;
        }
        float *dst = out + (q_start + i) * out_stride_tok + h * out_stride_head;
        float sum = 0.0f;
        for (int64_t d = 0; d < D; ++d) dst[d] = 0.0f;
        for (int64_t sp = 0; sp < nspans; ++sp) {
            const float *p = part + sp * stride;
            const float ms = p[slots * D + slot];
            if (ms == -FLT_MAX) continue;
            const float w = expf(ms - m);
            sum += p[slots * D + slots + slot] * w;
            for (int64_t d = 0; d < D; ++d) dst[d] += p[slot * D + d] * w;
        }
        const float inv = 1.0f / sum;
        for (int64_t d = 0; d < D; ++d) dst[d] *= inv;
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
    const int64_t slots = (QUERY_BLOCK * group + ROWS - 1) / ROWS * ROWS; /* most row slots of a task */
    /* Units: one chunk's query block and KV head; a unit whose keys cross a multiple of SPAN is split
     * into one task per span, merged afterwards. */
    int64_t nunits = 0;
    for (int64_t c = 0; c < num_chunks; ++c) nunits += num_kv_heads * ((Q_LEN(c) + QUERY_BLOCK - 1) / QUERY_BLOCK);
    struct unit { int64_t c, i0, i1, g, span0, nspans, task0, part; } *units = malloc(sizeof(struct unit) * (size_t)(nunits + 1));
    if (units == NULL) return -1;
    int64_t u = 0, ntasks = 0, part_floats = 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t context = SEQ_LEN(c) - Q_LEN(c);
        for (int64_t i0 = 0; i0 < Q_LEN(c); i0 += QUERY_BLOCK) {
            const int64_t i1 = i0 + QUERY_BLOCK < Q_LEN(c) ? i0 + QUERY_BLOCK : Q_LEN(c);
            const int64_t span0 = first_block_key(context, i0, window, block_size) / SPAN;
            const int64_t nspans = (context + i1 + SPAN - 1) / SPAN - span0;
            const int64_t unit_slots = ((i1 - i0) * group + ROWS - 1) / ROWS * ROWS;
            for (int64_t g = 0; g < num_kv_heads; ++g, ++u) {
                units[u] = (struct unit){c, i0, i1, g, span0, nspans, ntasks, nspans > 1 ? part_floats : -1};
                ntasks += nspans;
                if (nspans > 1) part_floats += nspans * unit_slots * (head_dim + 2);
            }
        }
    }
    units[nunits].task0 = ntasks;
    float *parts = part_floats > 0 ? malloc(sizeof(float) * (size_t)part_floats) : NULL;
    if (part_floats > 0 && parts == NULL) {
        free(units);
        return -1;
    }
    const size_t floats = task_scratch_floats(head_dim, slots);
    int failed = 0;
#pragma omp parallel if (ntasks > 1)
    {
        float *buf = scratch_reserve(floats) ? scratch : NULL;
        if (buf == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        int64_t k = 0;
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < ntasks; ++task) {
            if (buf == NULL) continue;
            while (units[k + 1].task0 <= task) ++k; /* tasks come in increasing order per thread */
            while (units[k].task0 > task) --k;
            const struct unit *un = &units[k];
            const int64_t sp = task - un->task0, c = un->c;
            const int64_t unit_slots = ((un->i1 - un->i0) * group + ROWS - 1) / ROWS * ROWS;
            float *part = un->part < 0 ? NULL : parts + un->part + sp * unit_slots * (head_dim + 2);
            const int64_t span_lo = un->nspans > 1 ? (un->span0 + sp) * SPAN : 0;
            const int64_t span_hi = un->nspans > 1 ? span_lo + SPAN : SEQ_LEN(c);
            prefill_task(q, q_stride_tok, q_stride_head, k_cache, v_cache, block_tables + TABLE_ROW(c) * table_stride,
                         Q_START(c), Q_LEN(c), SEQ_LEN(c), un->i0, un->i1, un->g, span_lo, span_hi, out, out_stride_tok,
                         out_stride_head, part, group, num_kv_heads, head_dim, block_size, scale, buf, window, soft_cap);
        }
        if (parts != NULL) {
#pragma omp for schedule(dynamic)
            for (int64_t v = 0; v < nunits; ++v) {
                const struct unit *un = &units[v];
                if (un->part < 0 || failed) continue;
                merge_spans(parts + un->part, un->nspans, Q_START(un->c), un->i0, un->i1, un->g, out, out_stride_tok,
                            out_stride_head, group, head_dim);
            }
        }
    }
    free(parts);
    free(units);
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
