/*
 * Fused elementwise parts of a decoder layer on the CPU, float32, one pass over each row:
 * RMSNorm (optionally after adding the residual), SiLU-and-mul, and rotary embedding in place
 * (the softmax-type reductions are in softmax_cpu.c).
 * Rows are independent, so results never depend on what else is in the batch.
 */
#include <math.h>
#include <stdint.h>

/* Parallel only when there is enough work to pay for waking the other threads. */
#define PARALLEL_MIN_ELEMENTS (1 << 16)

/* out = weight * (s * rsqrt(mean(s^2) + eps)) with s = x (+ residual, also written to res_out). */
void rms_norm_f32(const float *x, int64_t x_stride, const float *residual, int64_t res_stride,
                  float *out, int64_t out_stride, float *res_out, int64_t res_out_stride,
                  const float *weight, int64_t rows, int64_t hidden, float eps)
{
#pragma omp parallel for if (rows * hidden >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * x_stride;
        float *o = out + r * out_stride;
        const float *s = xr;
        if (residual != 0) {
            const float *rr = residual + r * res_stride;
            float *ro = res_out + r * res_out_stride;
#pragma omp simd
            for (int64_t i = 0; i < hidden; ++i) ro[i] = xr[i] + rr[i];
            s = ro;
        }
        float sq = 0.0f;
#pragma omp simd reduction(+ : sq)
        for (int64_t i = 0; i < hidden; ++i) sq += s[i] * s[i];
        const float inv = 1.0f / sqrtf(sq / (float)hidden + eps);
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) o[i] = weight[i] * (s[i] * inv);
    }
}

/* out[r, i] = silu(x[r, i]) * x[r, d + i]. */
void silu_and_mul_f32(const float *x, int64_t x_stride, float *out, int64_t out_stride, int64_t rows, int64_t d)
{
#pragma omp parallel for if (rows * d >= PARALLEL_MIN_ELEMENTS)
    for (int64_t r = 0; r < rows; ++r) {
        const float *g = x + r * x_stride;
        const float *u = g + d;
        float *o = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) o[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* Rotary embedding of x[t, h, :] in place, for heads [0, num_heads), with cos/sin rows
 * [max_pos, head_dim / 2]: each pair (x1, x2) of frequency i -> (x1 cos - x2 sin, x2 cos + x1 sin).
 * The pairs are (i, i + head_dim / 2) ("rotate half", HF Llama's layout) or, with ``interleaved``,
 * (2i, 2i + 1) (the layout of llama.cpp's GGUF q/k rows, which the model then keeps as stored). */
void rotary_f32(float *x, int64_t stride_t, int64_t stride_h, int64_t tokens, int64_t num_heads,
                int64_t head_dim, const int64_t *positions, const float *cos_cache, const float *sin_cache,
                int64_t interleaved)
{
    const int64_t half = head_dim / 2;
#pragma omp parallel for if (tokens * num_heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *c = cos_cache + positions[t] * half;
        const float *s = sin_cache + positions[t] * half;
        for (int64_t h = 0; h < num_heads; ++h) {
            float *x1 = x + t * stride_t + h * stride_h;
            if (interleaved) {
#pragma omp simd
                for (int64_t i = 0; i < half; ++i) {
                    const float a = x1[2 * i], b = x1[2 * i + 1];
                    x1[2 * i] = a * c[i] - b * s[i];
                    x1[2 * i + 1] = b * c[i] + a * s[i];
                }
                continue;
            }
            float *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}
