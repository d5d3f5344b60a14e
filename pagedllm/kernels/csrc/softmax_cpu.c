/*
 * Softmax-type reductions of float32 rows on the CPU: the softmax of an attention score row (used
 * by the decode and prefill attention kernels) and the maximum, argmax and log-sum-exp of a logits
 * row (used by the sampler). With AVX-512 both use one vector exp (exp16) and mask the last partial
 * vector instead of finishing the row one float at a time; other CPUs use portable loops that the
 * compiler vectorises with glibc's libmvec.
 */
#include <math.h>
#include <stdint.h>

/* Parallel only when there is enough work to pay for waking the other threads. */
#define PARALLEL_MIN_ELEMENTS (1 << 16)

#if defined(__AVX512F__)
#include <float.h>
#include <immintrin.h>

/* e^x for the 16 lanes of x, within 2 ulp of expf: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in
 * two so that n ln2 is exact), e^r by its Taylor series to r^7 (error under 1e-8), scaled by 2^n.
 * Lanes below -104 give 0 (or the smallest denormal), above 88.7 infinity. */
static inline __attribute__((always_inline)) __m512 exp16(__m512 x)
{
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* ``s[j] = e^(s[j] - m)`` for j in [a, b), 0 for the other j in [0, n); returns the sum. ``n`` is a
 * multiple of 16 (a tile of the prefill kernel's online softmax). */
float exp_shifted_f32(float *s, int64_t n, int64_t a, int64_t b, float m)
{
    const __m512 vm = _mm512_set1_ps(m);
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
        const __m512i j = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)t));
        const __mmask16 in = _mm512_cmpge_epi32_mask(j, _mm512_set1_epi32((int)a)) &
                             _mm512_cmplt_epi32_mask(j, _mm512_set1_epi32((int)b));
        const __m512 e = _mm512_maskz_mov_ps(in, exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm)));
        _mm512_storeu_ps(s + t, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    return _mm512_reduce_add_ps(vsum);
}

/* ``s[0:n]`` (n >= 1) replaced by its softmax. Sixteen lanes at a time, the last partial vector
 * masked (prefill score rows are short: a scalar tail would cost more than the rest of the row). */
void softmax_row_f32(float *s, int64_t n)
{
    const __m512 lowest = _mm512_set1_ps(-FLT_MAX);
    const int64_t full = n / 16 * 16;
    const __mmask16 tail = (__mmask16)((1u << (n - full)) - 1u);
    __m512 vmax = lowest;
    for (int64_t t = 0; t < full; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(s + t));
    vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(lowest, tail, s + full));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t t = 0; t < full; t += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
        _mm512_storeu_ps(s + t, e);
        vsum = _mm512_add_ps(vsum, e);
    }
    const __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full), m)));
    _mm512_mask_storeu_ps(s + full, tail, e);
    vsum = _mm512_add_ps(vsum, e);
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
    for (int64_t t = 0; t < full; t += 16) _mm512_storeu_ps(s + t, _mm512_mul_ps(_mm512_loadu_ps(s + t), inv));
    _mm512_mask_storeu_ps(s + full, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + full), inv));
}
#else
/* ``s[j] = e^(s[j] - m)`` for j in [a, b), 0 for the other j in [0, n); returns the sum. */
float exp_shifted_f32(float *s, int64_t n, int64_t a, int64_t b, float m)
{
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
        s[t] = t >= a && t < b ? expf(s[t] - m) : 0.0f;
        sum += s[t];
    }
    return sum;
}

/* ``s[0:n]`` (n >= 1) replaced by its softmax. */
void softmax_row_f32(float *s, int64_t n)
{
    float m = s[0];
#pragma omp simd reduction(max : m)
    for (int64_t t = 1; t < n; ++t) m = s[t] > m ? s[t] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
        s[t] = expf(s[t] - m);
        sum += s[t];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) s[t] *= inv;
}
#endif

/* Per row of x [rows, n] (row stride x_stride): the maximum, the first index holding it, and
 * log(sum(exp(x))). Entries may be -inf (masked tokens); a row whose maximum is not finite gets
 * lse = max. Compiled without the finite-math assumption of -ffast-math so those checks hold. */
__attribute__((optimize("no-finite-math-only"))) void max_logsumexp_f32(
    const float *x, int64_t x_stride, int64_t rows, int64_t n, float *max_out, int64_t *argmax_out, float *lse_out)
{
#pragma omp parallel for if (rows * n >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * x_stride;
#if defined(__AVX512F__)
        const int64_t full = n / 16 * 16;
        const __mmask16 tail = (__mmask16)((1u << (n - full)) - 1u);
        const __m512 ninf = _mm512_set1_ps(-INFINITY);
        __m512 vmax = ninf;
        for (int64_t i = 0; i < full; i += 16) vmax = _mm512_max_ps(_mm512_loadu_ps(xr + i), vmax);
        vmax = _mm512_max_ps(_mm512_mask_loadu_ps(ninf, tail, xr + full), vmax);
        const float m = _mm512_reduce_max_ps(vmax);
        const __m512 vm = _mm512_set1_ps(m);
        int64_t arg = 0;
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 in = i < full ? (__mmask16)0xFFFF : tail;
            const __mmask16 hit = _mm512_mask_cmp_ps_mask(in, _mm512_maskz_loadu_ps(in, xr + i), vm, _CMP_EQ_OQ);
            if (hit) {
                arg = i + __builtin_ctz(hit);
                break;
            }
        }
        float sum = 0.0f;
        if (isfinite(m)) {
            __m512 vsum = _mm512_setzero_ps();
            for (int64_t i = 0; i < full; i += 16) vsum = _mm512_add_ps(vsum, exp16(_mm512_sub_ps(_mm512_loadu_ps(xr + i), vm)));
            vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, xr + full), vm))));
            sum = _mm512_reduce_add_ps(vsum);
        }
#else
        float m = xr[0];
        for (int64_t i = 1; i < n; ++i) m = xr[i] > m ? xr[i] : m;
        int64_t arg = 0;
        while (arg < n - 1 && xr[arg] != m) ++arg;
        float sum = 0.0f;
        if (isfinite(m)) {
#pragma omp simd reduction(+ : sum)
            for (int64_t i = 0; i < n; ++i) sum += expf(xr[i] - m);
        }
#endif
        max_out[r] = m;
        argmax_out[r] = arg;
        lse_out[r] = isfinite(m) ? m + logf(sum) : m;
    }
}
