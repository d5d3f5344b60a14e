/*
 * Matrix products of the linear layers, float32: out[m, n] = x[m, k] @ weight[n, k]^T (+ bias).
 *
 * The weight is stored once, at load time, as column panels: panel j holds output columns
 * [32j, 32j + 32) as ``k`` rows of 32 contiguous floats (``panels[(j * k + kk) * 32 + c] =
 * weight[32j + c, kk]``, zero past ``n``). A product walks the panels; for each it keeps a tile of up
 * to MR_MAX rows x 32 columns of ``out`` in vector registers over the whole ``k`` loop (one panel
 * row and one broadcast ``x`` value feed 2 * MR_MAX fused multiply-adds), then the next rows reuse
 * the panel from cache. While the tiles of panel j run, panel j + 1 is prefetched into the L2 cache
 * line by line, each tile a share of its lines spread evenly over its loop, so streaming the weights
 * from memory overlaps the arithmetic at a steady rate: in a decode step every weight is read once
 * per step and few rows use it, the regime where a BLAS that waits on each cache miss loses a third
 * of its time (and where prefetching a whole panel in a burst fills the core's miss buffers and
 * stalls its own loads). The rows of x are first copied tile by tile into k-major order, so a tile's
 * broadcasts for one step of k are adjacent floats. Rows are taken MC at a time so a prefill's x
 * block stays in cache while the panels pass.
 *
 * Each thread owns a contiguous range of panels (output columns), so threads never write the same
 * memory, and each output element is the sum over k in order 0..k-1 whatever the number of rows or
 * their grouping into tiles: a row's result does not depend on the batch it is in.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NR 32 /* panel width: output columns per panel (two 16-float vectors) */
#if defined(__AVX512F__)
#define MR_MAX 12 /* 24 accumulators of the 32 vector registers */
#else
#define MR_MAX 4 /* 16 registers: 2 x 4 accumulators of two 256-bit halves each */
#endif
#define MC 384 /* rows per pass over the panels */

typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* Floats in the panel form of an [n, k] weight. */
int64_t panel_weight_floats(int64_t n, int64_t k)
{
    return (n + NR - 1) / NR * NR * k;
}

/* Store ``weight`` [n, k] (row-major, as nn.Linear holds it) as panels (see the top of the file). */
void pack_panels_f32(const float *weight, int64_t n, int64_t k, float *panels)
{
    const int64_t num_panels = (n + NR - 1) / NR;
#pragma omp parallel for
    for (int64_t j = 0; j < num_panels; ++j) {
        float *dst = panels + j * k * NR;
        for (int64_t kk = 0; kk < k; ++kk)
            for (int64_t c = 0; c < NR; ++c) {
                const int64_t col = j * NR + c;
                dst[kk * NR + c] = col < n ? weight[col * k + kk] : 0.0f;
            }
    }
}

/* Pack rows [0, rows) of x (row stride ldx) for tile-sized groups: the rows of tile i (balanced
 * sizes, as panel_linear_f32 forms them) stored k-major, ``xp[r0 * k + kk * mr + r]``, so a tile's
 * broadcasts for one kk are adjacent floats behind one pointer. */
static void pack_rows(const float *x, int64_t ldx, int64_t rows, int64_t k, int64_t tiles, float *xp)
{
#pragma omp for schedule(static)
    for (int64_t i = 0; i < tiles; ++i) {
        const int64_t r0 = rows * i / tiles, mr = rows * (i + 1) / tiles - r0;
        float *dst = xp + r0 * k;
        for (int64_t kk = 0; kk < k; ++kk)
            for (int64_t r = 0; r < mr; ++r) dst[kk * mr + r] = x[(r0 + r) * ldx + kk];
    }
}

/* One tile: MR packed rows of x times one panel into out[:, 0:ncols]. Prefetches ``npf`` cache
 * lines from ``pf`` into L2, spread evenly over the k loop (two per iteration at most). */
static inline __attribute__((always_inline)) void tile(
    const int MR, const float *restrict xp, const float *restrict panel, int64_t k,
    const float *restrict bias, float *restrict out, int64_t ldo, int ncols, const float *pf, int64_t npf)
{
    v16 acc0[MR_MAX], acc1[MR_MAX];
#pragma GCC unroll 12
    for (int i = 0; i < MR; ++i) {
        acc0[i] = (v16){0};
        acc1[i] = (v16){0};
    }
    const int64_t every = npf > 0 && k / npf > 0 ? k / npf : 1; /* iterations per prefetch */
    int64_t at = 0, issued = 0;
    for (int64_t kk = 0; kk < k; ++kk) {
        const v16 b0 = *(const v16 *)(panel + kk * NR), b1 = *(const v16 *)(panel + kk * NR + 16);
        if (kk == at && issued < npf) {
            __builtin_prefetch(pf + issued * 16, 0, 2);
            if (every == 1 && issued + 1 < npf) __builtin_prefetch(pf + ++issued * 16, 0, 2);
            ++issued;
            at += every;
        }
#pragma GCC unroll 12
        for (int i = 0; i < MR; ++i) {
            const float a = xp[kk * MR + i];
            acc0[i] += a * b0;
            acc1[i] += a * b1;
        }
    }
    float bias_cols[NR] = {0};
    if (bias) memcpy(bias_cols, bias, sizeof(float) * (size_t)ncols);
    const v16 bias0 = *(const v16 *)bias_cols, bias1 = *(const v16 *)(bias_cols + 16);
    if (ncols == NR) {
#pragma GCC unroll 12
        for (int i = 0; i < MR; ++i) {
            *(v16 *)(out + i * ldo) = acc0[i] + bias0;
            *(v16 *)(out + i * ldo + 16) = acc1[i] + bias1;
        }
    } else { /* the last panel of a weight whose n is not a multiple of NR */
        for (int i = 0; i < MR; ++i) {
            float row[NR];
            *(v16 *)row = acc0[i] + bias0;
            *(v16 *)(row + 16) = acc1[i] + bias1;
            memcpy(out + i * ldo, row, sizeof(float) * (size_t)ncols);
        }
    }
}

#define TILE_CASE(R) \
    case R: tile(R, xp, panel, k, bias, out, ldo, ncols, pf, npf); break;

/* ``tile`` with the row count a compile-time constant, so the accumulators live in registers. */
static void tile_rows(int rows, const float *xp, const float *panel, int64_t k, const float *bias, float *out,
                      int64_t ldo, int ncols, const float *pf, int64_t npf)
{
    switch (rows) {
        TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4)
#if MR_MAX > 4
        TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12)
#endif
        default: break;
    }
}

/* For other kernels that keep weights as panels (the mixture-of-experts products in moe_cpu.c): the
 * most rows one tile takes, and one tile of ``rows`` (1..MR_MAX) rows packed k-major as
 * ``xp[kk * rows + r]`` times one panel, no bias, with ``npf`` lines of ``pf`` prefetched. */
int64_t panel_tile_max_rows(void)
{
    return MR_MAX;
}

void panel_tile_f32(int rows, const float *xp, const float *panel, int64_t k, float *out, int64_t ldo, int ncols,
                    const float *pf, int64_t npf)
{
    tile_rows(rows, xp, panel, k, NULL, out, ldo, ncols, pf, npf);
}

/* out[m, n] (row stride ldo) = x[m, k] (row stride ldx) @ weight^T (+ bias[n]), weight as panels.
 * Returns 0, or -1 when the packed rows could not be allocated. */
int panel_linear_f32(const float *x, int64_t ldx, const float *panels, const float *bias, float *out,
                     int64_t ldo, int64_t m, int64_t n, int64_t k)
{
    const int64_t num_panels = (n + NR - 1) / NR;
    if (m <= 0 || num_panels == 0) return 0;
    float *xp = malloc(sizeof(float) * (size_t)((m < MC ? m : MC) * k));
    if (xp == NULL) return -1;
    const int64_t lines = k * NR / 16; /* cache lines of one panel */
#pragma omp parallel if (m * n * k >= 32768)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t j0 = num_panels * t / nt, j1 = num_panels * (t + 1) / nt;
        for (int64_t r = 0; r < m; r += MC) {
            const int64_t rows = m - r < MC ? m - r : MC;
            const int64_t tiles = (rows + MR_MAX - 1) / MR_MAX; /* of balanced sizes */
            pack_rows(x + r * ldx, ldx, rows, k, tiles, xp); /* ends with a barrier */
            for (int64_t j = j0; j < j1; ++j) {
                const float *panel = panels + j * k * NR;
                const float *next = j + 1 < j1 ? panel + k * NR : NULL;
                const int ncols = (int)(n - j * NR < NR ? n - j * NR : NR);
                const float *b = bias ? bias + j * NR : NULL;
                for (int64_t i = 0; i < tiles; ++i) {
                    const int64_t r0 = rows * i / tiles, r1 = rows * (i + 1) / tiles;
                    /* Each tile prefetches its share of the next panel's lines. */
                    const int64_t s0 = lines * i / tiles, s1 = lines * (i + 1) / tiles;
                    tile_rows((int)(r1 - r0), xp + r0 * k, panel, k, b, out + (r + r0) * ldo + j * NR, ldo, ncols,
                              next ? next + s0 * 16 : NULL, next ? s1 - s0 : 0);
                }
            }
#pragma omp barrier
        }
    }
    free(xp);
    return 0;
}
