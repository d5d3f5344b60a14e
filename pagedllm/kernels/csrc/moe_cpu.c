/*
 * Mixture-of-experts expert products, float32, in one call for a whole batch of tokens.
 *
 * Each token t has K (expert, weight) pairs. The pairs are sorted by expert (a counting sort, stable,
 * so within an expert they keep token order); then, for every expert that received pairs,
 *     h = x[rows] @ gate_up[e]^T            [n_e, 2I]
 *     a = silu(h[:, :I]) * h[:, I:]
 *     y = a @ down[e]^T                     [n_e, H]
 * and finally out[t] = sum_j weight[t, j] * y[pair (t, j)], summed in j order.
 *
 * The expert weights are held in the panel layout of the dense layers (linear_cpu.c), one expert
 * after another: gate_up as the panels of a [2I, H] weight, down as those of an [H, I] weight. Each
 * expert's rows are cut into tiles of at most panel_tile_max_rows() rows (balanced sizes, never
 * spanning two experts) and packed k-major, so one tile times one panel is linear_cpu.c's register
 * tile. Work items are (expert, panel): a thread takes a contiguous run of them, weighted by the rows
 * each multiplies plus a fixed share for reading the panel (so a prompt's crowded experts and a
 * decode step's thin ones both split evenly), runs every tile of the expert over the panel while the
 * panel is in cache, and prefetches the expert's next panel meanwhile. In a decode step every expert
 * panel that received a token streams from memory once, overlapped with the arithmetic; in a prompt
 * chunk the same tiles run at the register tile's arithmetic rate. Every output element is a sum over
 * k in order 0..k-1 whatever the batch, so a token's result does not depend on the other tokens.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#define NR 32 /* panel width, as in linear_cpu.c */
#define CHUNK_FLOATS (1 << 18) /* packed rows kept in cache per pass over the panels (1 MiB) */

/* linear_cpu.c */
int64_t panel_tile_max_rows(void);
void panel_tile_f32(int rows, const float *xp, const float *panel, int64_t k, float *out, int64_t ldo, int ncols,
                    const float *pf, int64_t npf);

/* Tiles of the sorted pairs: tile i covers sorted rows [r0[i], r1[i]) of one expert; the tiles of
 * expert e are [first[e], first[e + 1]). */
typedef struct {
    int64_t *r0, *r1, *first;
} Tiles;

/* The rows of tile i (length k each; ``src`` maps a sorted row to its input row, or NULL for the row
 * itself) packed k-major at xp + r0 * k. With ``gated``, the input row is [gate | up] of width 2k and
 * the packed value is silu(gate) * up. */
static void pack_tile(const float *in, int64_t ldi, const int64_t *src, int64_t r0, int64_t r1, int64_t k, int gated,
                      float *xp)
{
    const int64_t mr = r1 - r0;
    float *dst = xp + r0 * k;
    for (int64_t r = 0; r < mr; ++r) {
        const float *row = in + (src ? src[r0 + r] : r0 + r) * ldi;
        if (gated) {
            for (int64_t kk = 0; kk < k; ++kk) {
                const float g = row[kk];
                dst[kk * mr + r] = g / (1.0f + expf(-g)) * row[k + kk];
            }
        } else {
            for (int64_t kk = 0; kk < k; ++kk) dst[kk * mr + r] = row[kk];
        }
    }
}

/* One product phase, called by every thread of a parallel region: for each expert e that received
 * rows, out[rows of e, :n] = xp(rows of e) @ weight_e^T with weight_e the panels at
 * ``panels + e * expert_floats`` of an [n, k] weight. Thread ``t`` of ``nt`` runs its share of the
 * (expert, panel) items in order. */
static void product_phase(const Tiles *tiles, const int64_t *offsets, int64_t E, const float *xp,
                          const float *panels, int64_t expert_floats, int64_t n, int64_t k, float *out, int64_t ldo,
                          int64_t t, int64_t nt)
{
    const int64_t num_panels = (n + NR - 1) / NR, lines = k * NR / 16;
    const int64_t read_cost = 4; /* reading a panel, in rows' worth of work */
    int64_t total = 0;
    for (int64_t e = 0; e < E; ++e)
        if (offsets[e + 1] > offsets[e]) total += num_panels * (offsets[e + 1] - offsets[e] + read_cost);
    /* Item (e, j) starts at cost base_e + j * cost_e; this thread runs those starting in [lo, hi). */
    const int64_t lo = total * t / nt, hi = total * (t + 1) / nt;
    int64_t base = 0;
    for (int64_t e = 0; e < E && base < hi; ++e) {
        const int64_t rows = offsets[e + 1] - offsets[e];
        if (rows == 0) continue;
        const int64_t cost = rows + read_cost, end = base + num_panels * cost;
        if (end > lo) {
            const int64_t j0 = lo > base ? (lo - base + cost - 1) / cost : 0;
            const int64_t j1 = hi < end ? (hi - base + cost - 1) / cost : num_panels;
            const float *expert = panels + e * expert_floats;
            /* The expert's tiles in chunks of about CHUNK_FLOATS packed floats, each chunk kept in
             * cache while this thread's panels of the expert pass over it. */
            for (int64_t c0 = tiles->first[e], t1 = tiles->first[e + 1]; c0 < t1;) {
                int64_t c1 = c0 + 1;
                while (c1 < t1 && (tiles->r1[c1] - tiles->r0[c0]) * k <= CHUNK_FLOATS) ++c1;
                const int64_t nts = c1 - c0;
                for (int64_t j = j0; j < j1; ++j) {
                    const float *panel = expert + j * k * NR;
                    /* Prefetched meanwhile: this chunk's next panel, or the first for the next chunk. */
                    const float *next = j + 1 < j1 ? panel + k * NR : c1 < t1 ? expert + j0 * k * NR : NULL;
                    const int ncols = (int)(n - j * NR < NR ? n - j * NR : NR);
                    for (int64_t i = c0; i < c1; ++i) {
                        const int64_t r0 = tiles->r0[i], s0 = lines * (i - c0) / nts, s1 = lines * (i - c0 + 1) / nts;
                        panel_tile_f32((int)(tiles->r1[i] - r0), xp + r0 * k, panel, k, out + r0 * ldo + j * NR,
                                       ldo, ncols, next ? next + s0 * 16 : NULL, next ? s1 - s0 : 0);
                    }
                }
                c0 = c1;
            }
        }
        base = end;
    }
}

/* Floats of one expert's panels: gate_up ([2I, H]) when ``which`` is 0, down ([H, I]) when 1. */
int64_t moe_expert_panel_floats(int64_t H, int64_t I, int64_t which)
{
    return which == 0 ? (2 * I + NR - 1) / NR * NR * H : (H + NR - 1) / NR * NR * I;
}

/*
 * out[T, H] = the mixture of experts of x[T, H] (row stride ldx), see the top of the file.
 * ids / weights: [T, K] (int64 expert ids in [0, E), float32 weights). gate_up / down: E experts'
 * panels, moe_expert_panel_floats(H, I, 0 / 1) floats each. Scratch: ``h`` T*K*2I floats, ``y``
 * T*K*H, ``xp`` T*K*max(H, I).
 * Returns 0, -1 when the index arrays could not be allocated, -2 for an expert id out of range.
 */
int moe_experts_panels_f32(const float *x, int64_t ldx, int64_t T, int64_t H, int64_t I, int64_t E, int64_t K,
                           const int64_t *ids, const float *weights, const float *gate_up, const float *down,
                           float *h, float *y, float *xp, float *out)
{
    const int64_t P = T * K;
    if (P == 0) return 0;
    for (int64_t p = 0; p < P; ++p)
        if (ids[p] < 0 || ids[p] >= E) return -2;
    const int64_t mr_max = panel_tile_max_rows();
    int64_t *offsets = calloc((size_t)(E + 1), sizeof(int64_t));
    int64_t *fill = malloc(sizeof(int64_t) * (size_t)E);
    int64_t *token = malloc(sizeof(int64_t) * (size_t)P); /* sorted pair -> token row */
    int64_t *slot = malloc(sizeof(int64_t) * (size_t)P);  /* pair t*K+j -> sorted position */
    Tiles tiles = {malloc(sizeof(int64_t) * (size_t)(P + E)), malloc(sizeof(int64_t) * (size_t)(P + E)),
                   malloc(sizeof(int64_t) * (size_t)(E + 1))};
    int rc = 0;
    if (!offsets || !fill || !token || !slot || !tiles.r0 || !tiles.r1 || !tiles.first) {
        rc = -1;
        goto done;
    }
    for (int64_t p = 0; p < P; ++p) ++offsets[ids[p] + 1];
    for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
    for (int64_t e = 0; e < E; ++e) fill[e] = offsets[e];
    for (int64_t p = 0; p < P; ++p) {
        const int64_t s = fill[ids[p]]++;
        token[s] = p / K;
        slot[p] = s;
    }
    int64_t num_tiles = 0;
    for (int64_t e = 0; e < E; ++e) {
        const int64_t rows = offsets[e + 1] - offsets[e], count = (rows + mr_max - 1) / mr_max;
        tiles.first[e] = num_tiles;
        for (int64_t i = 0; i < count; ++i, ++num_tiles) {
            tiles.r0[num_tiles] = offsets[e] + rows * i / count;
            tiles.r1[num_tiles] = offsets[e] + rows * (i + 1) / count;
        }
    }
    tiles.first[E] = num_tiles;
    const int64_t up_floats = moe_expert_panel_floats(H, I, 0), down_floats = moe_expert_panel_floats(H, I, 1);
#pragma omp parallel if (P * H * I >= 65536)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_tiles; ++i) pack_tile(x, ldx, token, tiles.r0[i], tiles.r1[i], H, 0, xp);
        product_phase(&tiles, offsets, E, xp, gate_up, up_floats, 2 * I, H, h, 2 * I, t, nt);
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t i = 0; i < num_tiles; ++i) pack_tile(h, 2 * I, NULL, tiles.r0[i], tiles.r1[i], I, 1, xp);
        product_phase(&tiles, offsets, E, xp, down, down_floats, H, I, y, H, t, nt);
#pragma omp barrier
        /* Weighted sum of each token's K expert outputs, in j order. */
#pragma omp for schedule(static)
        for (int64_t tok = 0; tok < T; ++tok) {
            float *o = out + tok * H;
            const float *y0 = y + slot[tok * K] * H;
            const float w0 = weights[tok * K];
            for (int64_t c = 0; c < H; ++c) o[c] = w0 * y0[c];
            for (int64_t j = 1; j < K; ++j) {
                const float *yj = y + slot[tok * K + j] * H;
                const float wj = weights[tok * K + j];
                for (int64_t c = 0; c < H; ++c) o[c] += wj * yj[c];
            }
        }
    }
done:
    free(offsets);
    free(fill);
    free(token);
    free(slot);
    free(tiles.r0);
    free(tiles.r1);
    free(tiles.first);
    return rc;
}
