/*
 * Products of many rows with GGUF-quantized weights on the AMX tile units (bfloat16):
 * y[m, n] = x[m, k] @ W[n, k]^T, W in the block layout of quant_cpu.c (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K,
 * Q6_K), for prompts: where m is large the integer kernels are bound by their arithmetic, and one
 * AMX tile instruction does 16 x 16 x 32 multiply-adds.
 *
 * How: x is rounded to bfloat16 once, in the tile units' pair-interleaved layout (for each block of
 * 16 rows, padded with zero rows: [k / 2][16 rows][2]). The threads take panels of groups of 16 output
 * columns (up to 1 MiB, about three per thread) one at a time; a panel's weight rows are dequantized
 * (float32, then rounded to bfloat16) into a per-thread scratch buffer, row by row as they are
 * stored, so that no float copy of the weight outlives the call and the weight is expanded once per
 * product. Then 2 x 2 tiles of 16 columns x 16 rows accumulate in float32 over k in steps of 32
 * (TDPBF16PS), the panel's rows in the A tiles, x in the B tiles, in passes of 512 values of k (the
 * B tiles of a pass stay in L1); each finished tile is transposed into y with streaming stores.
 *
 * Numbers: each product term is x and W rounded to bfloat16 (8 significant bits, relative error at
 * most 2^-9 each), multiplied exactly and summed in float32 in an order fixed by k alone, so a row's
 * result does not depend on the other rows of x nor on the thread count (only on this path being
 * taken: quant_cpu.c's integer kernels round differently).
 *
 * Compiled only where the compiler targets AMX-BF16 (gcc/clang with -march=native on such a CPU); at
 * run time the tile data must also be granted by Linux (arch_prctl ARCH_REQ_XCOMP_PERM), which
 * amx_quant_available() asks for once. amx_quant_matmul_f32 returns AERR_NO_AMX where either is
 * missing, and the caller takes the integer kernels.
 */
#define _GNU_SOURCE
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { AQ4_0 = 2, AQ4_1 = 3, AQ8_0 = 8, AQ4_K = 12, AQ5_K = 13, AQ6_K = 14 };
enum { AERR_TYPE = -1, AERR_SHAPE = -2, AERR_MEMORY = -3, AERR_NO_AMX = -4 };

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512BF16__) && defined(__F16C__) && defined(__linux__)
#define HAVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state; /* 0 not asked yet, 1 granted, -1 refused */

static int amx_granted(void)
{
    int s;
#pragma omp atomic read
    s = amx_state;
    if (s == 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
#pragma omp atomic write
        amx_state = s;
    }
    return s == 1;
}

static int block_values(int64_t type)
{
    switch (type) {
        case AQ4_0: case AQ4_1: case AQ8_0: return 32;
        case AQ4_K: case AQ5_K: case AQ6_K: return 256;
        default: return 0;
    }
}

static int block_bytes(int64_t type)
{
    switch (type) {
        case AQ4_0: return 18;
        case AQ4_1: return 20;
        case AQ8_0: return 34;
        case AQ4_K: return 144;
        case AQ5_K: return 176;
        case AQ6_K: return 210;
        default: return 0;
    }
}

#define INLINE static inline __attribute__((always_inline))

INLINE float h2f(const uint8_t *p)
{
    return _cvtsh_ss((uint16_t)(p[0] | p[1] << 8));
}

INLINE __m512 u8_to_ps(__m128i v) /* 16 bytes, unsigned */
{
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}

/* 32 floats (lo: values 0-15, hi: 16-31) as bfloat16 at out (rounded to nearest even). */
INLINE void put32(__m512 lo, __m512 hi, uint16_t *out)
{
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* 32 values of one sub-block: out[l] = a * q[l] + b for the 32 unsigned quants in q. */
INLINE void affine32(__m256i q, float a, float b, uint16_t *out)
{
    const __m512 va = _mm512_set1_ps(a), vb = _mm512_set1_ps(b);
    put32(_mm512_fmadd_ps(u8_to_ps(_mm256_castsi256_si128(q)), va, vb),
          _mm512_fmadd_ps(u8_to_ps(_mm256_extracti128_si256(q, 1)), va, vb), out);
}

/* One block of ``type`` at w as bfloat16 (32 or 256 values; each computed in float32 first). */
static void dequant_block(int64_t type, const uint8_t *w, uint16_t *out)
{
    const __m256i m0f = _mm256_set1_epi8(15);
    switch (type) {
        case AQ4_0: case AQ4_1: {
            const float d = h2f(w), m = type == AQ4_1 ? h2f(w + 2) : -8.0f * d;
            const __m128i qs = _mm_loadu_si128((const __m128i *)(w + (type == AQ4_1 ? 4 : 2)));
            affine32(_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), m0f), d, m, out);
            break;
        }
        case AQ8_0: {
            const __m512 d = _mm512_set1_ps(h2f(w));
            const __m128i q0 = _mm_loadu_si128((const __m128i *)(w + 2)), q1 = _mm_loadu_si128((const __m128i *)(w + 18));
            put32(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d),
                  _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d), out);
            break;
        }
        case AQ4_K: case AQ5_K: {
            const int five = type == AQ5_K;
            const float d = h2f(w), dmin = h2f(w + 2);
            const uint8_t *s = w + 4, *qs = w + (five ? 48 : 16);
            const __m256i hb = five ? _mm256_loadu_si256((const __m256i *)(w + 16)) : _mm256_setzero_si256();
            for (int j = 0; j < 8; ++j) {
                int sc, mn;
                if (j < 4) {
                    sc = s[j] & 63;
                    mn = s[j + 4] & 63;
                } else {
                    sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4;
                    mn = (s[j + 4] >> 4) | (s[j] >> 6) << 4;
                }
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
                __m256i q = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(raw, 4) : raw, m0f);
                if (five)
                    q = _mm256_or_si256(
                        q, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, j), _mm256_set1_epi8(1)), 4));
                affine32(q, d * (float)sc, -(dmin * (float)mn), out + 32 * j);
            }
            break;
        }
        case AQ6_K: {
            const uint8_t *ql = w, *qh = w + 128;
            const int8_t *sc = (const int8_t *)(w + 192);
            const float d = h2f(w + 208);
            for (int h = 0; h < 2; ++h) {
                const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
                for (int kk = 0; kk < 4; ++kk) {
                    __m256i l = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32 * (kk & 1)));
                    if (kk >= 2) l = _mm256_srli_epi16(l, 4);
                    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hb, 2 * kk), _mm256_set1_epi8(3));
                    const __m256i q = _mm256_or_si256(_mm256_and_si256(l, m0f), _mm256_slli_epi16(hi, 4));
                    const float d0 = d * (float)sc[8 * h + 2 * kk], d1 = d * (float)sc[8 * h + 2 * kk + 1];
                    put32(_mm512_fmadd_ps(u8_to_ps(_mm256_castsi256_si128(q)), _mm512_set1_ps(d0),
                                          _mm512_set1_ps(-32.0f * d0)),
                          _mm512_fmadd_ps(u8_to_ps(_mm256_extracti128_si256(q, 1)), _mm512_set1_ps(d1),
                                          _mm512_set1_ps(-32.0f * d1)),
                          out + 128 * h + 32 * kk);
                }
            }
            break;
        }
        default: break;
    }
}

/* Transpose 16 x 16 32-bit elements in place (r[i] row i). */
INLINE void transpose16(__m512i r[16])
{
    __m512i t[16];
    for (int i = 0; i < 8; ++i) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
        r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    /* r[4i + c] holds, in its 128-bit lane L, column 4L + c of rows 4i..4i+3 */
    for (int c = 0; c < 4; ++c) {
        const __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), b = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xdd);
        const __m512i e = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
        const __m512i f = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xdd);
        t[c] = _mm512_shuffle_i32x4(a, e, 0x88);
        t[c + 8] = _mm512_shuffle_i32x4(a, e, 0xdd);
        t[c + 4] = _mm512_shuffle_i32x4(b, f, 0x88);
        t[c + 12] = _mm512_shuffle_i32x4(b, f, 0xdd);
    }
    for (int i = 0; i < 16; ++i) r[i] = t[i];
}

/* The group of 16 weight rows w[c0 .. c0 + valid) (zeros past ``valid``) as bfloat16 rows of k values,
 * ``ps`` apart: the A tiles of its products. */
static void fill_group(int64_t type, const uint8_t *w, int64_t row_bytes, int valid, int64_t k, uint16_t *out,
                       int64_t ps)
{
    const int qb = block_values(type), bb = block_bytes(type);
    for (int r = 0; r < 16; ++r) {
        if (r < valid)
            for (int64_t b = 0; b < k / qb; ++b) dequant_block(type, w + r * row_bytes + b * bb, out + r * ps + b * qb);
        else
            memset(out + r * ps, 0, sizeof(uint16_t) * (size_t)k);
    }
}

/* Token blocks [t0, t1) of x (16 rows each, zeros past row m; row stride ldx) as bfloat16 pairs, the
 * B tiles of the products: block t at xp + t * k * 8, where word (k / 2) * 16 + i holds values
 * (k, k + 1) of its row i. */
static void pack_rows(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t t0, int64_t t1, uint32_t *xp)
{
    for (int64_t t = t0; t < t1; ++t)
        for (int64_t c = 0; c < k; c += 32) {
            __m512i v[16];
            for (int r = 0; r < 16; ++r) {
                const int64_t row = 16 * t + r;
                v[r] = row < m ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + row * ldx + c + 16),
                                                               _mm512_loadu_ps(x + row * ldx + c))
                               : _mm512_setzero_si512();
            }
            transpose16(v);
            for (int i = 0; i < 16; ++i) _mm512_storeu_si512(xp + t * k * 8 + (c / 2 + i) * 16, v[i]);
        }
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

static void configure_tiles(void)
{
    tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; ++t) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

/* Values of k per pass over a panel's groups: the B tiles of a pass (2 x 16 rows of x, 32 KiB) stay
 * in L1 while the groups' A tiles stream from L2; the sums of the other passes wait in ``acc``. */
#define K_PASS 512

/* Tile s (0-3) stored to buf (16 x 16 floats, 64 bytes a row). */
INLINE void store_tile(int s, float *buf)
{
    switch (s) {
        case 0: _tile_stored(0, buf, 64); break;
        case 1: _tile_stored(1, buf, 64); break;
        case 2: _tile_stored(2, buf, 64); break;
        default: _tile_stored(3, buf, 64); break;
    }
}

/* y for column groups (g, g + 1) x token blocks (t, t + 1): ``a`` is group g's 16 bfloat16 weight
 * rows (``ps`` apart; group g + 1's follow), ``b`` token block t's pairs (block t + 1's k * 8 words
 * on); ``two_g`` / ``two_t``: whether the second group / block exists. Tile 2 * i + j sums group
 * g + i times block t + j over k in [kc0, kc1), added to the sums in ``acc`` (1024 floats) unless kc0
 * is 0, kept there unless kc1 is k, else transposed and stored to y's rows 16 (t + j) .. and
 * columns col0 + 16 i ... */
static void tiles_2x2(const uint16_t *a, int64_t ps, const uint32_t *b, int64_t k, int64_t m, int64_t t, int two_t,
                      int64_t col0, int64_t n, int two_g, float *y, int64_t ldy, float *buf, int64_t kc0, int64_t kc1,
                      float *acc)
{
    if (kc0 == 0) {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
    } else {
        _tile_loadd(0, acc, 64);
        _tile_loadd(1, acc + 256, 64);
        _tile_loadd(2, acc + 512, 64);
        _tile_loadd(3, acc + 768, 64);
    }
    const uint16_t *a0 = a, *a1 = a + 16 * ps;
    const uint32_t *b0 = b, *b1 = b + k * 8;
    const int64_t lda = 2 * ps;
    if (two_t && two_g) {
        for (int64_t c = kc0; c < kc1; c += 32) {
            _tile_loadd(4, a0 + c, lda);
            _tile_loadd(6, b0 + c * 8, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(7, b1 + c * 8, 64);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(5, a1 + c, lda);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    } else {
        for (int64_t c = kc0; c < kc1; c += 32) {
            _tile_loadd(4, a0 + c, lda);
            _tile_loadd(6, b0 + c * 8, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two_t) {
                _tile_loadd(7, b1 + c * 8, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (two_g) {
                _tile_loadd(5, a1 + c, lda);
                _tile_dpbf16ps(2, 5, 6);
            }
        }
    }
    if (kc1 < k) {
        _tile_stored(0, acc, 64);
        _tile_stored(1, acc + 256, 64);
        _tile_stored(2, acc + 512, 64);
        _tile_stored(3, acc + 768, 64);
        return;
    }
    for (int i = 0; i < 2; ++i) {
        if (i && !two_g) break;
        const int64_t o = col0 + 16 * i;
        const int cols = (int)(n - o < 16 ? n - o : 16);
        for (int j = 0; j < 2; ++j) {
            if (j && !two_t) break;
            const int64_t r = 16 * (t + j);
            const int rows = (int)(m - r < 16 ? m - r : 16);
            store_tile(2 * i + j, buf);
            __m512i v[16];
            for (int q = 0; q < 16; ++q) v[q] = _mm512_load_si512(buf + 16 * q);
            transpose16(v); /* row q: token r + q, the 16 columns */
            float *dst = y + r * ldy + o;
            if (rows == 16 && cols == 16 && ((uintptr_t)dst & 63) == 0 && (ldy & 15) == 0)
                /* streaming stores: y's rows, often a power of two apart, would otherwise crowd the
                 * panel out of L2 (measured: 0.68x at 16384 columns) */
                for (int q = 0; q < 16; ++q) _mm512_stream_ps(dst + q * ldy, _mm512_castsi512_ps(v[q]));
            else
                for (int q = 0; q < rows; ++q)
                    _mm512_mask_storeu_ps(dst + q * ldy, (__mmask16)((1u << cols) - 1), _mm512_castsi512_ps(v[q]));
        }
    }
}
#endif /* HAVE_AMX */

/* 1 where amx_quant_matmul_f32 runs here (compiled for AMX-BF16 and tile data granted), else 0. */
int64_t amx_quant_available(void)
{
#ifdef HAVE_AMX
    return amx_granted();
#else
    return 0;
#endif
}

#define PANEL_BYTES (1024 * 1024)

/* Groups of 16 columns a thread dequantizes at once: a panel of up to 1 MiB (half of L2), so that x,
 * which streams from L3 once per panel, is read as few times as L2 allows. */
static int64_t panel_groups(int64_t k)
{
    const int64_t g = PANEL_BYTES / (k * 32 > 0 ? k * 32 : 1);
    return g < 2 ? 2 : g > 32 ? 32 : g & ~(int64_t)1;
}

/* y[m, n] (row stride ldy) = x[m, k] (row stride ldx) @ W^T on the AMX tiles, W the [n, k] weight of
 * GGML type ``type`` in its GGUF block layout. Returns 0, AERR_TYPE, AERR_SHAPE, AERR_MEMORY or
 * AERR_NO_AMX (not compiled for AMX, or Linux refused the tile data: nothing written). */
int64_t amx_quant_matmul_f32(int64_t type, const void *w, int64_t n, int64_t k, const float *x, int64_t m,
                             int64_t ldx, float *y, int64_t ldy)
{
#ifndef HAVE_AMX
    (void)type, (void)w, (void)n, (void)k, (void)x, (void)m, (void)ldx, (void)y, (void)ldy;
    (void)panel_groups;
    return AERR_NO_AMX;
#else
    const int qb = block_values(type);
    if (!qb) return AERR_TYPE;
    if (n < 0 || k < 0 || m < 0 || k % qb) return AERR_SHAPE;
    if (!amx_granted()) return AERR_NO_AMX;
    if (m == 0 || n == 0) return 0;
    if (k == 0) {
        for (int64_t i = 0; i < m; ++i) memset(y + i * ldy, 0, sizeof(float) * (size_t)n);
        return 0;
    }
    const int64_t row_bytes = k / qb * block_bytes(type), tblocks = (m + 15) / 16, groups = (n + 15) / 16;
    uint32_t *xp = aligned_alloc(64, (size_t)(tblocks * k * 8 * 4));
    if (xp == NULL) return AERR_MEMORY;
    /* A panel's rows 64 bytes longer than k values: a tile's 16 rows then fall in different L1 sets */
    const int64_t pg = panel_groups(k), ps = k + 32;
    int err = 0;
#pragma omp parallel
    {
        const int64_t nt = omp_get_num_threads(), th = omp_get_thread_num();
        pack_rows(x, ldx, m, k, tblocks * th / nt, tblocks * (th + 1) / nt, xp);
        uint16_t *panel = aligned_alloc(64, (size_t)(pg * 16 * ps * 2));
        float *buf = aligned_alloc(64, sizeof(float) * (256 + (pg / 2 + 1) * 1024));
        float *acc = buf + 256;
        if (panel == NULL || buf == NULL) {
#pragma omp atomic write
            err = AERR_MEMORY;
        }
#pragma omp barrier
        if (!err) { /* (err is the same for every thread after the barrier) */
            configure_tiles();
            /* Panels handed out one at a time, about three per thread: a thread that the OS sets
             * aside (another process on its core) leaves its share to the others. */
            int64_t chunk = groups / (3 * nt) & ~(int64_t)1;
            chunk = chunk < 2 ? 2 : chunk > pg ? pg : chunk;
            const int64_t panels = (groups + chunk - 1) / chunk;
#pragma omp for schedule(dynamic, 1) nowait
            for (int64_t pi = 0; pi < panels; ++pi) {
                const int64_t p0 = pi * chunk, p1 = p0 + chunk < groups ? p0 + chunk : groups;
                for (int64_t g = p0; g < p1; ++g) {
                    const int64_t c0 = 16 * g, valid = n - c0 < 16 ? n - c0 : 16;
                    fill_group(type, (const uint8_t *)w + c0 * row_bytes, row_bytes, (int)valid, k,
                               panel + (g - p0) * 16 * ps, ps);
                }
                for (int64_t t = 0; t < tblocks; t += 2)
                    for (int64_t kc0 = 0; kc0 < k; kc0 += K_PASS) {
                        const int64_t kc1 = kc0 + K_PASS < k ? kc0 + K_PASS : k;
                        for (int64_t g = p0; g < p1; g += 2)
                            tiles_2x2(panel + (g - p0) * 16 * ps, ps, xp + t * k * 8, k, m, t, t + 1 < tblocks, 16 * g,
                                      n, g + 1 < p1, y, ldy, buf, kc0, kc1, acc + (g - p0) / 2 * 1024);
                    }
            }
            _tile_release();
            _mm_sfence(); /* the streaming stores are visible before the region ends */
        }
        free(panel);
        free(buf);
    }
    free(xp);
    return err;
#endif
}
