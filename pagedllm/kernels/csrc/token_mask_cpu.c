/*
 * The structured-output token mask on float32 logits: every token whose bit is 0 in its row's
 * bitmask (xgrammar's layout: 32 tokens per int32 word, token t at bit t % 32 of word t / 32) gets
 * -inf. A grammar usually allows few tokens, so most words are 0 and their 32 logits are set without
 * looking at bits; a word of all ones is skipped.
 */
#include <math.h>
#include <stdint.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Rows rows[0..num_rows): logits row r at logits + r * logits_stride, its mask at mask + r * mask_stride;
 * tokens [0, vocab). */
void apply_token_bitmask_f32(float *logits, int64_t logits_stride, const int32_t *mask, int64_t mask_stride,
                             const int64_t *rows, int64_t num_rows, int64_t vocab)
{
    const int64_t words = (vocab + 31) / 32;
#pragma omp parallel for if (num_rows * vocab >= (1 << 20))
    for (int64_t i = 0; i < num_rows; ++i) {
        float *x = logits + rows[i] * logits_stride;
        const uint32_t *m = (const uint32_t *)(mask + rows[i] * mask_stride);
        for (int64_t w = 0; w < words; ++w) {
            const uint32_t bits = m[w];
            if (bits == 0xFFFFFFFFu) continue;
            const int64_t base = w * 32;
            const int64_t n = vocab - base < 32 ? vocab - base : 32;
#if defined(__AVX512F__)
            const __m512 ninf = _mm512_set1_ps(-INFINITY);
            const uint32_t in = n == 32 ? 0xFFFFFFFFu : ((1u << n) - 1u);
            const uint32_t off = ~bits & in;
            _mm512_mask_storeu_ps(x + base, (__mmask16)(off & 0xFFFFu), ninf);
            _mm512_mask_storeu_ps(x + base + 16, (__mmask16)(off >> 16), ninf);
#else
            for (int64_t b = 0; b < n; ++b)
                if (!((bits >> b) & 1u)) x[base + b] = -INFINITY;
#endif
        }
    }
}
