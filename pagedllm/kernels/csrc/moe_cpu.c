/*
 * Mixture-of-experts expert products, float32, in one call for a whole batch of tokens.
 *
 * Each token t has K (expert, weight) pairs. The pairs are sorted by expert (a counting sort, stable,
 * so within an expert they keep token order); then, for every expert that received pairs,
 *     h = x[rows] @ gate_up[e]^T            [n_e, 2I]
 *     a = silu(h[:, :I]) * h[:, I:]         (in place, over the gate half of h)
 *     y = a @ down[e]^T                     [n_e, H]
 * and finally out[t] = sum_j weight[t, j] * y[pair (t, j)], summed in j order.
 *
 * The weights stay in transformers' row-major layout (gate_up [E, 2I, H], down [E, H, I]): an output
 * element is a dot product of a token row with a weight row. Work items are (expert, block of 32
 * weight rows); a thread takes a block, keeps it in cache and runs every token row of that expert
 * over it, four rows at a time against two weight rows (eight vector accumulators), so each weight
 * row is read from memory once per call. Items are spread over the OpenMP threads dynamically
 * (experts receive very different numbers of tokens). Every output element is the dot product summed
 * in the same order whatever the batch, so a token's result does not depend on the other tokens.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

typedef float v16 __attribute__((vector_size(64), aligned(4)));

#define ROWS_PER_BLOCK 32 /* weight rows (outputs) per work item */

static inline float hsum(v16 v)
{
    float s = 0.0f;
    for (int i = 0; i < 16; ++i) s += v[i];
    return s;
}

/* For MR token rows ``xr[r]`` (length k) and weight rows [n0, n1) of ``w`` ([*, k] row-major):
 * out_r[n] = dot(xr[r], w[n]). */
static inline __attribute__((always_inline)) void dot_rows(
    const int MR, const float *const *xr, float *const *outr, const float *restrict w, int64_t k, int64_t n0,
    int64_t n1)
{
    const int64_t kv = k / 16 * 16;
    int64_t n = n0;
    for (; n + 2 <= n1; n += 2) {
        const float *w0 = w + n * k, *w1 = w0 + k;
        v16 acc0[4], acc1[4];
        for (int r = 0; r < MR; ++r) acc0[r] = acc1[r] = (v16){0};
        for (int64_t kk = 0; kk < kv; kk += 16) {
            const v16 b0 = *(const v16 *)(w0 + kk), b1 = *(const v16 *)(w1 + kk);
            for (int r = 0; r < MR; ++r) {
                const v16 a = *(const v16 *)(xr[r] + kk);
                acc0[r] += a * b0;
                acc1[r] += a * b1;
            }
        }
        for (int r = 0; r < MR; ++r) {
            float s0 = hsum(acc0[r]), s1 = hsum(acc1[r]);
            for (int64_t kk = kv; kk < k; ++kk) {
                s0 += xr[r][kk] * w0[kk];
                s1 += xr[r][kk] * w1[kk];
            }
            outr[r][n] = s0;
            outr[r][n + 1] = s1;
        }
    }
    for (; n < n1; ++n) {
        const float *w0 = w + n * k;
        v16 acc0[4];
        for (int r = 0; r < MR; ++r) acc0[r] = (v16){0};
        for (int64_t kk = 0; kk < kv; kk += 16) {
            const v16 b0 = *(const v16 *)(w0 + kk);
            for (int r = 0; r < MR; ++r) acc0[r] += *(const v16 *)(xr[r] + kk) * b0;
        }
        for (int r = 0; r < MR; ++r) {
            float s0 = hsum(acc0[r]);
            for (int64_t kk = kv; kk < k; ++kk) s0 += xr[r][kk] * w0[kk];
            outr[r][n] = s0;
        }
    }
}

static void dot_rows_any(int mr, const float *const *xr, float *const *outr, const float *w, int64_t k, int64_t n0,
                         int64_t n1)
{
    switch (mr) {
        case 1: dot_rows(1, xr, outr, w, k, n0, n1); break;
        case 2: dot_rows(2, xr, outr, w, k, n0, n1); break;
        case 3: dot_rows(3, xr, outr, w, k, n0, n1); break;
        default: dot_rows(4, xr, outr, w, k, n0, n1); break;
    }
}

/* One work item: rows [p0, p1) of the sorted pairs times weight rows [n0, n1) of ``w`` [*, k].
 * Row p's input is ``in + src[p] * ldi`` (``src`` NULL: row p itself), its output ``out + p * ldo``. */
static void product_block(const float *in, int64_t ldi, const int64_t *src, int64_t p0, int64_t p1, const float *w,
                          int64_t k, int64_t n0, int64_t n1, float *out, int64_t ldo)
{
    for (int64_t p = p0; p < p1; p += 4) {
        const int mr = (int)(p1 - p < 4 ? p1 - p : 4);
        const float *xr[4];
        float *outr[4];
        for (int r = 0; r < mr; ++r) {
            const int64_t row = src ? src[p + r] : p + r;
            xr[r] = in + row * ldi;
            outr[r] = out + (p + r) * ldo;
        }
        dot_rows_any(mr, xr, outr, w, k, n0, n1);
    }
}

/*
 * out[T, H] = the mixture of experts of x[T, H] (row stride ldx), see the top of the file.
 * ids / weights: [T, K] (int64 expert ids in [0, E), float32 weights). gate_up [E, 2I, H], down
 * [E, H, I], contiguous. ``h`` is scratch of T*K*2I floats, ``y`` of T*K*H floats.
 * Returns 0, -1 when scratch indices could not be allocated, -2 for an expert id out of range.
 */
int moe_experts_f32(const float *x, int64_t ldx, int64_t T, int64_t H, int64_t I, int64_t E, int64_t K,
                    const int64_t *ids, const float *weights, const float *gate_up, const float *down, float *h,
                    float *y, float *out)
{
    const int64_t P = T * K;
    if (P == 0) return 0;
    for (int64_t p = 0; p < P; ++p)
        if (ids[p] < 0 || ids[p] >= E) return -2;
    int64_t *offsets = calloc((size_t)(E + 1), sizeof(int64_t));
    int64_t *token = malloc(sizeof(int64_t) * (size_t)P); /* sorted pair -> token row */
    int64_t *slot = malloc(sizeof(int64_t) * (size_t)P);  /* pair t*K+j -> sorted position */
    if (!offsets || !token || !slot) {
        free(offsets);
        free(token);
        free(slot);
        return -1;
    }
    for (int64_t p = 0; p < P; ++p) ++offsets[ids[p] + 1];
    for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
    {
        int64_t *fill = malloc(sizeof(int64_t) * (size_t)E);
        if (!fill) {
            free(offsets);
            free(token);
            free(slot);
            return -1;
        }
        for (int64_t e = 0; e < E; ++e) fill[e] = offsets[e];
        for (int64_t p = 0; p < P; ++p) {
            const int64_t s = fill[ids[p]]++;
            token[s] = p / K;
            slot[p] = s;
        }
        free(fill);
    }
    const int64_t n_up = 2 * I, blocks_up = (n_up + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
    const int64_t blocks_down = (H + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
#pragma omp parallel if (P * H * I >= 65536)
    {
        /* gate_up products: items (expert, block of gate_up rows). */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < E * blocks_up; ++item) {
            const int64_t e = item / blocks_up, b = item % blocks_up;
            if (offsets[e] == offsets[e + 1]) continue;
            const int64_t n0 = b * ROWS_PER_BLOCK, n1 = n0 + ROWS_PER_BLOCK < n_up ? n0 + ROWS_PER_BLOCK : n_up;
            product_block(x, ldx, token, offsets[e], offsets[e + 1], gate_up + e * n_up * H, H, n0, n1, h, n_up);
        }
        /* SiLU-and-mul, in place over the gate half of each row of h. */
#pragma omp for schedule(static)
        for (int64_t p = 0; p < P; ++p) {
            float *row = h + p * n_up;
            for (int64_t j = 0; j < I; ++j) {
                const float g = row[j];
                row[j] = g / (1.0f + expf(-g)) * row[I + j];
            }
        }
        /* down products: items (expert, block of down rows). */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < E * blocks_down; ++item) {
            const int64_t e = item / blocks_down, b = item % blocks_down;
            if (offsets[e] == offsets[e + 1]) continue;
            const int64_t n0 = b * ROWS_PER_BLOCK, n1 = n0 + ROWS_PER_BLOCK < H ? n0 + ROWS_PER_BLOCK : H;
            product_block(h, n_up, NULL, offsets[e], offsets[e + 1], down + e * H * I, I, n0, n1, y, H);
        }
        /* Weighted sum of each token's K expert outputs, in j order. */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            float *o = out + t * H;
            const float *y0 = y + slot[t * K] * H;
            const float w0 = weights[t * K];
            for (int64_t c = 0; c < H; ++c) o[c] = w0 * y0[c];
            for (int64_t j = 1; j < K; ++j) {
                const float *yj = y + slot[t * K + j] * H;
                const float wj = weights[t * K + j];
                for (int64_t c = 0; c < H; ++c) o[c] += wj * yj[c];
            }
        }
    }
    free(offsets);
    free(token);
    free(slot);
    return 0;
}
