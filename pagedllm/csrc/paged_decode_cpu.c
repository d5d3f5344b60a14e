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
 * passes), so every K and V row is read once. head_dim 64 and 128 get specialised loops.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

/* Attend one sequence's query heads of KV heads [kv_begin, kv_end): scores for all of them are
 * computed from each K row in turn (rows are read whole and in memory order), then V likewise. */
static inline __attribute__((always_inline)) void decode_seq(
    const float *q, int64_t q_stride_head, const float *k_cache, const float *v_cache,
    const int32_t *table, int64_t len, float *out, int64_t out_stride_head,
    int64_t kv_begin, int64_t kv_end, int64_t group, const int64_t D, int64_t block_size,
    int64_t row_stride, int64_t block_stride, float scale, float *scores, float *acc)
{
    const int64_t h_begin = kv_begin * group, h_end = kv_end * group, nh = h_end - h_begin;
    for (int64_t start = 0; start < len; start += block_size) {
        const int64_t block = table[start / block_size];
        const float *kb = k_cache + block * block_stride;
        const int64_t n = len - start < block_size ? len - start : block_size;
        for (int64_t j = 0; j < n; ++j) {
            const float *kr = kb + j * row_stride;
            for (int64_t h = h_begin; h < h_end; ++h) {
                const float *qh = q + h * q_stride_head;
                const float *kh = kr + (h / group) * D;
                float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; ++d) dot += qh[d] * kh[d];
                scores[(h - h_begin) * len + start + j] = dot * scale;
            }
        }
    }
    for (int64_t i = 0; i < nh; ++i) {
        float *sg = scores + i * len;
        float m = sg[0];
        for (int64_t t = 1; t < len; ++t) m = sg[t] > m ? sg[t] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
            sg[t] = expf(sg[t] - m);
            sum += sg[t];
        }
        const float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
    }
    memset(acc, 0, sizeof(float) * (size_t)(nh * D));
    for (int64_t start = 0; start < len; start += block_size) {
        const float *vb = v_cache + (int64_t)table[start / block_size] * block_stride;
        const int64_t n = len - start < block_size ? len - start : block_size;
        for (int64_t j = 0; j < n; ++j) {
            const float *vr = vb + j * row_stride;
            for (int64_t h = h_begin; h < h_end; ++h) {
                const float p = scores[(h - h_begin) * len + start + j];
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

int paged_decode_attention_f32(
    const float *q, int64_t q_stride_seq, int64_t q_stride_head,
    const float *k_cache, const float *v_cache,
    const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens,
    float *out, int64_t out_stride_seq, int64_t out_stride_head,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_seq_len, float scale)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t row_stride = num_kv_heads * head_dim;
    const int64_t block_stride = block_size * row_stride;
    /* Whole sequences per task when there are enough of them; else one KV head per task. */
    const int64_t parts = num_seqs >= 4 * omp_get_max_threads() ? 1 : num_kv_heads;
    int failed = 0;
#pragma omp parallel
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
#define CALL(DIM) decode_seq(qs, q_stride_head, k_cache, v_cache, table, len, os, out_stride_head, kv_begin, \
                             kv_end, group, DIM, block_size, row_stride, block_stride, scale, scores, acc)
            switch (head_dim) {
            case 64: CALL(64); break;
            case 128: CALL(128); break;
            default: CALL(head_dim);
            }
#undef CALL
        }
        free(scores);
        free(acc);
    }
    return failed ? -1 : 0;
}
