/*
 * Paged decode attention on the CPU: one query token per sequence, K/V read in place from the
 * block-paged cache (no gathered copy), float32 throughout.
 *
 * Cache layout (per layer): k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim],
 * contiguous. Sequence s has seq_lens[s] tokens of context; position t lives in block
 * block_tables[s * table_stride + t / block_size] at offset t % block_size.
 *
 * A task is one sequence (or, when there are few sequences, one KV head of one): it computes the
 * scores of all its query heads from each K row in turn, so rows are read whole and in memory
 * order, then the softmax, then the weighted sum of V rows likewise. Scores are kept whole (two
 * passes), so every K and V row is read once. head_dim 64 and 128 get specialised loops; with
 * AVX-512 they are vectorised by hand (decode_seq_avx512), other sizes and CPUs use portable loops.
 *
 * Sliding window (paged_decode_attention_window_f32, window > 0): the query at position len - 1
 * sees keys lo = max(0, len - window) .. len - 1. Blocks before lo's block are never read (a KV
 * cache manager may have released them); the rows of lo's block before lo are scored with the
 * rest (they are held) and then given weight 0. Score buffers are indexed from the start of lo's
 * block (``base``), with ``span`` = len - base scores per query head. Soft-capping (soft_cap > 0)
 * maps each scaled score s to soft_cap * tanh(s / soft_cap) before the softmax.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

/* Rows of a sequence's block ``b`` that hold tokens (all but possibly the last block are full). */
static inline int64_t block_rows(int64_t b, int64_t len, int64_t block_size)
{
    return len - b * block_size < block_size ? len - b * block_size : block_size;
}

void softmax_row_f32(float *s, int64_t n); /* softmax_cpu.c */

/* Each of the ``rows`` score rows (``span`` floats each, the first ``skip`` of them before the
 * window) replaced by the softmax of its in-window part, soft-capped first when soft_cap > 0; the
 * scores before the window become 0. */
static inline void softmax_rows(float *scores, int64_t rows, int64_t span, int64_t skip, float soft_cap)
{
    for (int64_t i = 0; i < rows; ++i) {
        float *row = scores + i * span;
        if (soft_cap > 0.0f) {
            const float inv = 1.0f / soft_cap;
            for (int64_t j = skip; j < span; ++j) row[j] = soft_cap * tanhf(row[j] * inv);
        }
        softmax_row_f32(row + skip, span - skip);
        for (int64_t j = 0; j < skip; ++j) row[j] = 0.0f;
    }
}

/* Attend one sequence's query heads of KV heads [kv_begin, kv_end): scores for all of them are
 * computed from each K row in turn (rows are read whole and in memory order), then V likewise. */
static inline __attribute__((always_inline)) void decode_seq(
    const float *q, int64_t q_stride_head, const float *k_cache, const float *v_cache,
    const int32_t *table, int64_t len, float *out, int64_t out_stride_head,
    int64_t kv_begin, int64_t kv_end, int64_t group, const int64_t D, int64_t block_size,
    int64_t row_stride, int64_t block_stride, float scale, float *scores, float *acc, int64_t lo,
    float soft_cap)
{
    const int64_t h_begin = kv_begin * group, h_end = kv_end * group, nh = h_end - h_begin;
    const int64_t base = lo / block_size * block_size, span = len - base;
    for (int64_t start = base; start < len; start += block_size) {
        const int64_t block = table[start / block_size];
        const float *kb = k_cache + block * block_stride;
        const int64_t n = block_rows(start / block_size, len, block_size);
        for (int64_t j = 0; j < n; ++j) {
            const float *kr = kb + j * row_stride;
            for (int64_t h = h_begin; h < h_end; ++h) {
                const float *qh = q + h * q_stride_head;
                const float *kh = kr + (h / group) * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; ++d) dot += qh[d] * kh[d];
                scores[(h - h_begin) * span + start - base + j] = dot * scale;
            }
        }
    }
    softmax_rows(scores, nh, span, lo - base, soft_cap);
    memset(acc, 0, sizeof(float) * (size_t)(nh * D));
    for (int64_t start = base; start < len; start += block_size) {
        const float *vb = v_cache + (int64_t)table[start / block_size] * block_stride;
        const int64_t n = block_rows(start / block_size, len, block_size);
        for (int64_t j = 0; j < n; ++j) {
            const float *vr = vb + j * row_stride;
            for (int64_t h = h_begin; h < h_end; ++h) {
                const float p = scores[(h - h_begin) * span + start - base + j];
                const float *vh = vr + (h / group) * D;
                float *ah = acc + (h - h_begin) * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) ah[d] += p * vh[d];
            }
        }
    }
    for (int64_t h = h_begin; h < h_end; ++h)
        memcpy(out + h * out_stride_head, acc + (h - h_begin) * D, sizeof(float) * (size_t)D);
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* Blocks are prefetched this many blocks ahead, into L2: an L1 prefetch holds one of the core's
 * few line-fill buffers until the line arrives, so a block's worth of them stalls the loads of the
 * work in between; L2 prefetches have more requests in flight and leave the L1 to the kernel. */
#define PREFETCH_BLOCKS 2

/* Lane j of the result is the sum of v[j]'s 16 lanes (a transpose-and-add tree: 45 instructions
 * for 16 dot products instead of a full horizontal reduction for each). */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 v[16])
{
    __m512 b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i)
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i)
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; ++i)
        d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

/* Prefetch rows [r0, r1) of block ``b`` of a sequence (only the ones holding tokens), the part of
 * each row this task reads. */
static inline __attribute__((always_inline)) void prefetch_rows(
    const float *cache, const int32_t *table, int64_t b, int64_t len, int64_t block_size, int64_t block_stride,
    int64_t row_stride, int64_t offset, int64_t width, int64_t r0, int64_t r1)
{
    const int64_t n = block_rows(b, len, block_size);
    const float *rows = cache + (int64_t)table[b] * block_stride + offset;
    for (int64_t j = r0; j < (r1 < n ? r1 : n); ++j)
        for (int64_t d = 0; d < width; d += 16) _mm_prefetch((const char *)(rows + j * row_stride + d), _MM_HINT_T1);
}

/* decode_seq for head_dim a multiple of 16 (64, 128) with AVX-512: scores of 16 K rows at a time
 * per query head (row products accumulated across lanes, then one sum16), and the weighted sum of
 * V rows with each head's output held in registers for a block at a time. The block
 * PREFETCH_BLOCKS ahead is prefetched while one is computed, a share of its rows with each head or KV
 * group (blocks are scattered, so the hardware prefetcher cannot follow them). */
static inline __attribute__((always_inline)) void decode_seq_avx512(
    const float *q, int64_t q_stride_head, const float *k_cache, const float *v_cache,
    const int32_t *table, int64_t len, float *out, int64_t out_stride_head,
    int64_t kv_begin, int64_t kv_end, int64_t group, const int64_t D, int64_t block_size,
    int64_t row_stride, int64_t block_stride, float scale, float *scores, float *acc, int64_t lo,
    float soft_cap)
{
    enum { MAXV = 8 };                 /* head_dim / 16 at most */
    const int64_t NV = D / 16;
    const int64_t h_begin = kv_begin * group, h_end = kv_end * group, nh = h_end - h_begin;
    const int64_t width = (kv_end - kv_begin) * D; /* floats of a row this task reads */
    const int64_t nblocks = (len + block_size - 1) / block_size;
    const int64_t b0 = lo / block_size, base = b0 * block_size, span = len - base;
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t b = b0; b < nblocks; ++b) {
        const int64_t start = b * block_size, n = block_rows(b, len, block_size);
        const float *kb = k_cache + (int64_t)table[b] * block_stride + kv_begin * D;
        /* The K block ahead (near the end, the first V blocks), a share of its rows per head so that
         * the prefetches spread over the block's work. */
        const float *next_cache = b + PREFETCH_BLOCKS < nblocks ? k_cache : v_cache;
        const int64_t next =
            b + PREFETCH_BLOCKS < nblocks ? b + PREFETCH_BLOCKS : b0 + b + PREFETCH_BLOCKS - nblocks;
        for (int64_t j0 = 0; j0 < n; j0 += 16) {
            const int64_t m = n - j0 < 16 ? n - j0 : 16;
            const __mmask16 mask = (__mmask16)((1u << m) - 1u);
            for (int64_t h = h_begin; h < h_end; ++h) {
                const int64_t i = h - h_begin;
                if (next < nblocks)
                    prefetch_rows(next_cache, table, next, len, block_size, block_stride, row_stride, kv_begin * D,
                                  width, j0 + i * 16 / nh, j0 + (i + 1) * 16 / nh);
                const float *qh = q + h * q_stride_head;
                const float *kh = kb + (h / group - kv_begin) * D + j0 * row_stride;
                __m512 qv[MAXV], rows[16];
                for (int64_t c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(qh + 16 * c);
                for (int64_t j = 0; j < 16; ++j) {
                    if (j < m) {
                        const float *kr = kh + j * row_stride;
                        __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
                        for (int64_t c = 1; c < NV; ++c) s = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), s);
                        rows[j] = s;
                    } else {
                        rows[j] = _mm512_setzero_ps();
                    }
                }
                _mm512_mask_storeu_ps(scores + (h - h_begin) * span + start - base + j0, mask,
                                      _mm512_mul_ps(sum16(rows), vscale));
            }
        }
    }
    softmax_rows(scores, nh, span, lo - base, soft_cap);
    memset(acc, 0, sizeof(float) * (size_t)(nh * D));
    /* Heads per register tile: 16 accumulators at most. */
    const int64_t chunk = 16 / NV < group ? 16 / NV : group;
    for (int64_t b = b0; b < nblocks; ++b) {
        const int64_t start = b * block_size, n = block_rows(b, len, block_size);
        const float *vb = v_cache + (int64_t)table[b] * block_stride + kv_begin * D;
        const int64_t ngroups = kv_end - kv_begin;
        for (int64_t g = kv_begin; g < kv_end; ++g) {
            if (b + PREFETCH_BLOCKS < nblocks)
                prefetch_rows(v_cache, table, b + PREFETCH_BLOCKS, len, block_size, block_stride, row_stride,
                              kv_begin * D, width, (g - kv_begin) * block_size / ngroups,
                              (g - kv_begin + 1) * block_size / ngroups);
            for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += chunk) {
                const int64_t hc = (g + 1) * group - h0 < chunk ? (g + 1) * group - h0 : chunk;
                __m512 a[16];
                for (int64_t i = 0; i < hc; ++i)
                    for (int64_t c = 0; c < NV; ++c) a[i * NV + c] = _mm512_loadu_ps(acc + (h0 + i - h_begin) * D + 16 * c);
                const float *vh = vb + (g - kv_begin) * D;
                const float *ph = scores + (h0 - h_begin) * span + start - base;
                for (int64_t j = 0; j < n; ++j) {
                    const float *vr = vh + j * row_stride;
                    __m512 vv[MAXV];
                    for (int64_t c = 0; c < NV; ++c) vv[c] = _mm512_loadu_ps(vr + 16 * c);
                    for (int64_t i = 0; i < hc; ++i) {
                        const __m512 p = _mm512_set1_ps(ph[i * span + j]);
                        for (int64_t c = 0; c < NV; ++c) a[i * NV + c] = _mm512_fmadd_ps(p, vv[c], a[i * NV + c]);
                    }
                }
                for (int64_t i = 0; i < hc; ++i)
                    for (int64_t c = 0; c < NV; ++c) _mm512_storeu_ps(acc + (h0 + i - h_begin) * D + 16 * c, a[i * NV + c]);
            }
        }
    }
    for (int64_t h = h_begin; h < h_end; ++h)
        memcpy(out + h * out_stride_head, acc + (h - h_begin) * D, sizeof(float) * (size_t)D);
}
#endif

#define PARALLEL_MIN_BYTES (256 << 10)

/* Returns 0, or -1 when a score buffer could not be allocated. ``window`` <= 0: no window;
 * ``soft_cap`` <= 0: no soft-capping. */
int paged_decode_attention_window_f32(
    const float *q, int64_t q_stride_seq, int64_t q_stride_head,
    const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens,
    float *out, int64_t out_stride_seq, int64_t out_stride_head,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_seq_len, float scale, int64_t window, float soft_cap)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * row_stride;
    /* Whole sequences per task when there are enough of them; else one KV head per task. */
    const int64_t parts = num_seqs >= 4 * omp_get_max_threads() ? 1 : num_kv_heads;
    /* Waking the other threads costs tens of microseconds: only worth it past a few hundred KiB. */
    int64_t total_len = 0;
    for (int64_t s = 0; s < num_seqs; ++s) total_len += window > 0 && seq_lens[s] > window ? window : seq_lens[s];
    const int parallel = total_len * row_stride * 2 * (int64_t)sizeof(float) >= PARALLEL_MIN_BYTES;
    int failed = 0;
#pragma omp parallel if (parallel)
    {
        float *scores = (float *)malloc(sizeof(float) * (size_t)(num_heads * (max_seq_len > 0 ? max_seq_len : 1)));
        float *acc = (float *)malloc(sizeof(float) * (size_t)(num_heads * head_dim));
        if (scores == NULL || acc == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t task = 0; task < num_seqs * parts; ++task) {
            if (scores == NULL || acc == NULL) continue;
            const int64_t s = task / parts;
            const int64_t kv_begin = parts == 1 ? 0 : task % parts;
            const int64_t kv_end = parts == 1 ? num_kv_heads : kv_begin + 1;
            const float *qs = q + s * q_stride_seq;
            float *os = out + s * out_stride_seq;
            const int32_t *table = block_tables + s * table_stride;
            const int64_t len = seq_lens[s];
            const int64_t lo = window > 0 && len > window ? len - window : 0;
#define CALL(FN, DIM) FN(qs, q_stride_head, k_cache, v_cache, table, len, os, out_stride_head, kv_begin, \
                             kv_end, group, DIM, block_size, row_stride, block_stride, scale, scores, acc, lo, soft_cap)
            switch (head_dim) {
#if defined(__AVX512F__)
            case 64: CALL(decode_seq_avx512, 64); break;
            case 128: CALL(decode_seq_avx512, 128); break;
#else
            case 64: CALL(decode_seq, 64); break;
            case 128: CALL(decode_seq, 128); break;
#endif
            default: CALL(decode_seq, head_dim);
            }
#undef CALL
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}

/* Full causal attention without soft-capping (the native decode layers call this one). */
int paged_decode_attention_f32(
    const float *q, int64_t q_stride_seq, int64_t q_stride_head,
    const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens,
    float *out, int64_t out_stride_seq, int64_t out_stride_head,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_seq_len, float scale)
{
    return paged_decode_attention_window_f32(q, q_stride_seq, q_stride_head, k_cache, v_cache, block_tables,
                                             table_stride, seq_lens, out, out_stride_seq, out_stride_head, num_seqs,
                                             num_heads, num_kv_heads, head_dim, block_size, max_seq_len, scale, 0,
                                             0.0f);
}
