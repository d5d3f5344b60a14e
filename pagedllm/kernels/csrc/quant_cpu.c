/*
 * Matrix products with GGUF-quantized weights kept in their original block layout:
 * y[m, n] = x[m, k] @ W[n, k]^T, row o of W being the k / QB blocks a GGUF file stores for it (the
 * bytes gguf.GGUFReader returns as the tensor's data, rows one after another), for these types
 * (f16 numbers little-endian; q the stored quants):
 *
 *   type  values bytes  layout of a block                                         a value
 *   Q4_0   32     18    d, qs[16] (value j: low nibble of qs[j]; j + 16: high)    d * (q - 8)
 *   Q4_1   32     20    d, m, qs[16] (as Q4_0)                                    d * q + m
 *   Q8_0   32     34    d, int8 q[32]                                             d * q
 *   Q4_K  256    144    d, dmin, scales[12] (8 6-bit scales sc_j, 8 6-bit mins    d * sc_j * q - dmin * m_j
 *                       m_j), qs[128] (sub-block j of 32 values: the low (j even)
 *                       or high nibbles of qs[32 * (j / 2) ...])
 *   Q5_K  256    176    d, dmin, scales[12], qh[32] (bit j of qh[l]: the 5th bit   as Q4_K
 *                       of value l of sub-block j), qs[128]
 *   Q6_K  256    210    ql[128], qh[64] (low 4 and high 2 bits), int8 scales[16]  d * sc_g * (q - 32)
 *                       (one per 16 values), d
 *
 * Each product first quantizes the rows of x to int8 (one float scale d = max|x| / 127 per 32 values
 * for the 32-value types, per 256 values for the K types, which also keep the sum of each 16 quants:
 * it carries the mins and offsets), then works on integers: per block (or sub-block) the integer dot
 * product of the weight's quants with x's, scaled by the float scales of both. So a weight is read
 * once, as stored (4.5 to 8.5 bits a value), and never expanded to float.
 *
 * Three paths, chosen when the file is compiled:
 * - AVX-512 with VNNI (+BW, VL): the 32-value types 16 output columns at a time, one per 32-bit lane:
 *   a block of 16 weight rows decoded once into 8 vectors of 16 rows x 4 quants (unsigned: Q4_0 and
 *   Q4_1 the nibbles, Q8_0 q + 128), each vpdpbusd'd with 4 of x's quants broadcast, so 8 vpdpbusd
 *   and 2-3 float operations per block make 512 multiply-adds (the offsets taken out with x's block
 *   sums: Q4_0's 8 and Q8_0's 128 exactly in integers, Q4_1's min in float). K types: 64 values of
 *   a block per 512-bit vector, sub-block scales applied in 16 bits with vpmaddubsw + vpdpwssd.
 * - AVX2 (+FMA): one 32-value block per 256-bit vector; vpmaddubsw + vpmaddwd, or the 256-bit VNNI
 *   instructions where AVX-VNNI is there (Q8_0 through the sign trick, so that no pair sum saturates).
 * - Portable C: each weight row decoded once to int8, then plain integer loops (any CPU).
 * quant_matmul_f32_portable always takes the portable path, so that it is tested on any machine.
 *
 * The threads split the output columns (weight rows) into contiguous ranges (AVX-512, 32-value types:
 * of whole groups of 16). A product's rows are taken in tiles (up to 12 rows with AVX-512's 32-value
 * path, 8 with its K path, 4 with AVX2), each weight block decoded once per tile (or, past 12 rows,
 * once per group of 16 columns); every output element is one row's sum over the blocks, in the same
 * order and with the same operations (in its own vector lane) whatever the tile, so a row's result
 * does not depend on the batch it is in (nor on the thread count), on every path and at every row
 * count. quant_dequantize_f32 expands rows of a weight to float32 exactly as gguf's NumPy
 * reference does (same operations, same rounding: bitwise equal), for products of many rows.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__F16C__)
#define QUANT_ISA 3
#elif defined(__AVX2__) && defined(__FMA__) && defined(__AVXVNNI__)
#define QUANT_ISA 2
#elif defined(__AVX2__) && defined(__FMA__)
#define QUANT_ISA 1
#else
#define QUANT_ISA 0
#endif
#if QUANT_ISA > 0 || defined(__F16C__)
#include <immintrin.h>
#endif

/* The dequantizers must round as NumPy does: no fused multiply-adds, no reassociation. */
#if defined(__clang__)
#define FP_STRICT_FN
#define FP_STRICT_BODY _Pragma("clang fp contract(off) reassociate(off)")
#elif defined(__GNUC__)
#define FP_STRICT_FN __attribute__((optimize("no-fast-math", "fp-contract=off")))
#define FP_STRICT_BODY
#else
#define FP_STRICT_FN
#define FP_STRICT_BODY
#endif

#define INLINE static inline __attribute__((always_inline))

/* GGML type ids (the values of gguf.GGMLQuantizationType). */
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

enum {
    ERR_TYPE = -1,   /* not one of the types above */
    ERR_SHAPE = -2,  /* k not a multiple of the block's values, or a negative size */
    ERR_MEMORY = -3, /* the quantized activations could not be allocated */
};

/* Values and bytes of one block of ``type``; 0 when the type is not supported. */
static int block_values(int64_t type)
{
    switch (type) {
        case Q4_0: case Q4_1: case Q8_0: return 32;
        case Q4_K: case Q5_K: case Q6_K: return 256;
        default: return 0;
    }
}

static int block_bytes(int64_t type)
{
    switch (type) {
        case Q4_0: return 18;
        case Q4_1: return 20;
        case Q8_0: return 34;
        case Q4_K: return 144;
        case Q5_K: return 176;
        case Q6_K: return 210;
        default: return 0;
    }
}

INLINE float f16_to_f32(const uint8_t *p)
{
    const uint16_t h = (uint16_t)(p[0] | p[1] << 8);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
    uint32_t bits;
    float out;
    if (e == 0x1f)
        bits = sign | 0x7f800000u | mant << 13; /* inf, nan */
    else if (e != 0)
        bits = sign | (e + 112) << 23 | mant << 13;
    else { /* zero or subnormal: mant * 2^-24, exact */
        const float f = (float)mant * 0x1p-24f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    memcpy(&out, &bits, 4);
    return out;
#endif
}

/* The 6-bit scales and mins of a Q4_K / Q5_K block (12 bytes at s). */
INLINE void k_scales(const uint8_t *s, uint8_t sc[8], uint8_t mn[8])
{
    for (int j = 0; j < 4; ++j) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (uint8_t)((s[j + 8] & 15) | (s[j] >> 6) << 4);
        mn[j + 4] = (uint8_t)((s[j + 8] >> 4) | (s[j + 4] >> 6) << 4);
    }
}

#if QUANT_ISA > 0
/* Software prefetch of the weight stream, ahead of the block at p (``bytes`` long) being read: into
 * L1 at PREFETCH_L1 bytes ahead and into L2 at PREFETCH_L2. Weight rows are read one after the other,
 * so this is one sequential stream per thread; the hardware prefetchers alone kept it at under half
 * the read bandwidth (measured: 11 GB/s of 24 on two threads, 1B Q4_K_M batch-1 decode; 21 GB/s with
 * these distances, which were the best of those tried). A prefetch past the end of the weight does
 * not fault. The AVX2 path prefetches the same way (not measured here: these machines take the
 * AVX-512 path). */
#define PREFETCH_L1 1024
#define PREFETCH_L2 12288
INLINE void prefetch_ahead(const uint8_t *p, int bytes)
{
    for (int off = 0; off < bytes; off += 64) {
        _mm_prefetch((const char *)p + PREFETCH_L1 + off, _MM_HINT_T0);
        _mm_prefetch((const char *)p + PREFETCH_L2 + off, _MM_HINT_T1);
    }
}

/* The same, 8 scales and 8 mins as the bytes of two 64-bit words (little-endian, as x86 is). */
INLINE void k_scales_packed(const uint8_t *s, uint64_t *sc, uint64_t *mn)
{
    uint32_t a, b, c;
    memcpy(&a, s, 4);
    memcpy(&b, s + 4, 4);
    memcpy(&c, s + 8, 4);
    const uint32_t sc_hi = (c & 0x0f0f0f0fu) | ((a >> 2) & 0x30303030u); /* bits 6-7 of byte j -> 4-5 */
    const uint32_t mn_hi = ((c >> 4) & 0x0f0f0f0fu) | ((b >> 2) & 0x30303030u);
    *sc = (a & 0x3f3f3f3fu) | (uint64_t)sc_hi << 32;
    *mn = (b & 0x3f3f3f3fu) | (uint64_t)mn_hi << 32;
}
#endif

/* ---------------------------------------------------------------------------------------------- */
/* Dequantization (bitwise as gguf.quants.dequantize)                                             */

FP_STRICT_FN static void dequant_q4_0(const uint8_t *w, int64_t nb, float *y)
{
    FP_STRICT_BODY
    for (int64_t b = 0; b < nb; ++b, w += 18, y += 32) {
        const float d = f16_to_f32(w);
        for (int j = 0; j < 16; ++j) {
            y[j] = d * (float)((w[2 + j] & 15) - 8);
            y[j + 16] = d * (float)((w[2 + j] >> 4) - 8);
        }
    }
}

FP_STRICT_FN static void dequant_q4_1(const uint8_t *w, int64_t nb, float *y)
{
    FP_STRICT_BODY
    for (int64_t b = 0; b < nb; ++b, w += 20, y += 32) {
        const float d = f16_to_f32(w), m = f16_to_f32(w + 2);
        for (int j = 0; j < 16; ++j) {
            y[j] = d * (float)(w[4 + j] & 15) + m;
            y[j + 16] = d * (float)(w[4 + j] >> 4) + m;
        }
    }
}

FP_STRICT_FN static void dequant_q8_0(const uint8_t *w, int64_t nb, float *y)
{
    FP_STRICT_BODY
    for (int64_t b = 0; b < nb; ++b, w += 34, y += 32) {
        const float d = f16_to_f32(w);
        for (int j = 0; j < 32; ++j) y[j] = (float)(int8_t)w[2 + j] * d;
    }
}

/* Q4_K (qh == NULL) and Q5_K. */
FP_STRICT_FN static void dequant_q45_k(const uint8_t *w, int64_t nb, int five, float *y)
{
    FP_STRICT_BODY
    for (int64_t b = 0; b < nb; ++b, w += five ? 176 : 144, y += 256) {
        const float d = f16_to_f32(w), dmin = f16_to_f32(w + 2);
        uint8_t sc[8], mn[8];
        k_scales(w + 4, sc, mn);
        const uint8_t *qh = w + 16, *qs = five ? w + 48 : w + 16;
        for (int j = 0; j < 8; ++j) {
            const float dl = d * (float)sc[j], ml = dmin * (float)mn[j];
            const int shift = (j & 1) * 4;
            for (int l = 0; l < 32; ++l) {
                int q = (qs[32 * (j / 2) + l] >> shift) & 15;
                if (five) q |= ((qh[l] >> j) & 1) << 4;
                y[32 * j + l] = dl * (float)q - ml;
            }
        }
    }
}

FP_STRICT_FN static void dequant_q6_k(const uint8_t *w, int64_t nb, float *y)
{
    FP_STRICT_BODY
    for (int64_t b = 0; b < nb; ++b, w += 210, y += 256) {
        const uint8_t *ql = w, *qh = w + 128;
        const int8_t *sc = (const int8_t *)(w + 192);
        const float d = f16_to_f32(w + 208);
        for (int h = 0; h < 2; ++h)
            for (int kk = 0; kk < 4; ++kk)
                for (int half = 0; half < 2; ++half) {
                    const float dl = d * (float)sc[8 * h + 2 * kk + half];
                    for (int l = 16 * half; l < 16 * half + 16; ++l) {
                        const int q = ((ql[64 * h + 32 * (kk & 1) + l] >> (4 * (kk >> 1))) & 15)
                                      | ((qh[32 * h + l] >> (2 * kk)) & 3) << 4;
                        y[128 * h + 32 * kk + l] = dl * (float)(q - 32);
                    }
                }
    }
}

static void dequant_row(int64_t type, const uint8_t *w, int64_t nb, float *y)
{
    switch (type) {
        case Q4_0: dequant_q4_0(w, nb, y); break;
        case Q4_1: dequant_q4_1(w, nb, y); break;
        case Q8_0: dequant_q8_0(w, nb, y); break;
        case Q4_K: dequant_q45_k(w, nb, 0, y); break;
        case Q5_K: dequant_q45_k(w, nb, 1, y); break;
        case Q6_K: dequant_q6_k(w, nb, y); break;
        default: break;
    }
}

/* out[r - row_begin, 0:k] = row r of the weight w ([rows, k] of ``type``) in float32. Returns 0, or
 * ERR_TYPE / ERR_SHAPE. */
int64_t quant_dequantize_f32(int64_t type, const void *w, int64_t row_begin, int64_t row_end, int64_t k, float *out)
{
    const int qb = block_values(type);
    if (!qb) return ERR_TYPE;
    if (k < 0 || k % qb || row_begin < 0 || row_end < row_begin) return ERR_SHAPE;
    const int64_t nb = k / qb, row_bytes = nb * block_bytes(type);
    const uint8_t *wb = (const uint8_t *)w;
#pragma omp parallel for schedule(static) if ((row_end - row_begin) * k >= (1 << 16))
    for (int64_t r = row_begin; r < row_end; ++r) dequant_row(type, wb + r * row_bytes, nb, out + (r - row_begin) * k);
    return 0;
}

/* out[i, 0:k] = row ids[i] of the weight w ([rows, k] of ``type``) in float32, for i < n (an embedding
 * lookup on a quantized table; ids must be valid rows). Returns 0, or ERR_TYPE / ERR_SHAPE. */
int64_t quant_gather_rows_f32(int64_t type, const void *w, const int64_t *ids, int64_t n, int64_t k, float *out)
{
    const int qb = block_values(type);
    if (!qb) return ERR_TYPE;
    if (k < 0 || k % qb || n < 0) return ERR_SHAPE;
    const int64_t nb = k / qb, row_bytes = nb * block_bytes(type);
    const uint8_t *wb = (const uint8_t *)w;
#pragma omp parallel for schedule(static) if (n * k >= (1 << 16))
    for (int64_t i = 0; i < n; ++i) dequant_row(type, wb + ids[i] * row_bytes, nb, out + i * k);
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* Activations: int8 per block, in the layout each path reads                                      */

/* q = round(x / d), d = max|x| / 127 over n values; returns d. */
INLINE float quantize_q8(const float *x, int n, int8_t *q)
{
    float amax = 0.0f;
    for (int i = 0; i < n; ++i) amax = fmaxf(amax, fabsf(x[i]));
    const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
    for (int i = 0; i < n; ++i) q[i] = (int8_t)lrintf(x[i] * id);
    return amax * (1.0f / 127.0f);
}

INLINE int sum_q8(const int8_t *q, int n)
{
    int s = 0;
    for (int i = 0; i < n; ++i) s += q[i];
    return s;
}

/* One 32-value block: quants, scale, scale * sum of quants (AVX2 and portable paths). */
typedef struct {
    int8_t q[32];
    float d, s;
} xblock32;

/* One 32-value block for the AVX-512 path: quants, scale, scale * sum of quants, and the integer
 * term of the weight type's quant offset (-8 * sum of quants for Q4_0, -128 * sum for Q8_0 whose
 * quants are offset by 128, 0 for Q4_1 whose min is a float: its term is d_w's m times s). */
typedef struct {
    int8_t q[32];
    float d, s;
    int32_t c, pad;
} xblock16;

/* One 256-value block (all paths). */
typedef struct {
    int8_t q[256];
    int16_t bsums[16]; /* sum of each 16 quants */
    float d;
    float pad[7];
} xblockk;

static void quantize_row32(const float *x, int64_t nb, xblock32 *out)
{
    for (int64_t b = 0; b < nb; ++b) {
        out[b].d = quantize_q8(x + 32 * b, 32, out[b].q);
        out[b].s = out[b].d * (float)sum_q8(out[b].q, 32);
    }
}

static void quantize_row16(int64_t type, const float *x, int64_t nb, xblock16 *out)
{
    const int32_t c = type == Q4_0 ? -8 : type == Q8_0 ? -128 : 0;
    for (int64_t b = 0; b < nb; ++b) {
        out[b].d = quantize_q8(x + 32 * b, 32, out[b].q);
        const int sum = sum_q8(out[b].q, 32);
        out[b].s = out[b].d * (float)sum;
        out[b].c = c * sum;
        out[b].pad = 0;
    }
}

static void quantize_rowk(const float *x, int64_t nb, xblockk *out)
{
    for (int64_t b = 0; b < nb; ++b) {
        out[b].d = quantize_q8(x + 256 * b, 256, out[b].q);
        for (int g = 0; g < 16; ++g) out[b].bsums[g] = (int16_t)sum_q8(out[b].q + 16 * g, 16);
        memset(out[b].pad, 0, sizeof out[b].pad);
    }
}

/* Bytes of one row's quantized activations for a path. */
static int64_t xrow_bytes(int64_t type, int64_t k, int simd)
{
    const int qb = block_values(type);
    const int64_t nb = k / qb;
    if (qb == 256) return nb * (int64_t)sizeof(xblockk);
    if (simd && QUANT_ISA == 3) return nb * (int64_t)sizeof(xblock16);
    return nb * (int64_t)sizeof(xblock32);
}

static void quantize_row(int64_t type, const float *x, int64_t k, int simd, void *out)
{
    const int qb = block_values(type);
    if (qb == 256)
        quantize_rowk(x, k / 256, (xblockk *)out);
    else if (simd && QUANT_ISA == 3)
        quantize_row16(type, x, k / 32, (xblock16 *)out);
    else
        quantize_row32(x, k / 32, (xblock32 *)out);
}

/* ---------------------------------------------------------------------------------------------- */
/* Portable path: a weight row decoded once to int8 quants and float (or integer) scales, then    */
/* dotted with every row of x.                                                                      */

/* Scratch for one decoded weight row. */
typedef struct {
    int8_t *q;   /* [k]: Q4_0 q - 8, Q4_1 q, Q8_0 q; Q4_K / Q5_K q; Q6_K q - 32 */
    float *d;    /* [blocks]: Q4_0 / Q4_1 / Q8_0 d; K types d */
    float *m;    /* [blocks]: Q4_1 m (else 0); Q4_K / Q5_K dmin (Q6_K 0) */
    int16_t *sc; /* [blocks * 16] K types: scale of each 16 values */
    int16_t *mn; /* [blocks * 16] K types: min of each 16 values (Q6_K 0) */
} wrow_t;

static void decode_row_portable(int64_t type, const uint8_t *w, int64_t nb, wrow_t *r)
{
    for (int64_t b = 0; b < nb; ++b) {
        switch (type) {
            case Q4_0: case Q4_1: {
                const uint8_t *blk = w + b * (type == Q4_0 ? 18 : 20), *qs = blk + (type == Q4_0 ? 2 : 4);
                const int off = type == Q4_0 ? 8 : 0;
                r->d[b] = f16_to_f32(blk);
                r->m[b] = type == Q4_1 ? f16_to_f32(blk + 2) : 0.0f;
                for (int j = 0; j < 16; ++j) {
                    r->q[32 * b + j] = (int8_t)((qs[j] & 15) - off);
                    r->q[32 * b + j + 16] = (int8_t)((qs[j] >> 4) - off);
                }
                break;
            }
            case Q8_0: {
                const uint8_t *blk = w + b * 34;
                r->d[b] = f16_to_f32(blk);
                r->m[b] = 0.0f;
                memcpy(r->q + 32 * b, blk + 2, 32);
                break;
            }
            case Q4_K: case Q5_K: {
                const int five = type == Q5_K;
                const uint8_t *blk = w + b * (five ? 176 : 144), *qh = blk + 16, *qs = blk + (five ? 48 : 16);
                uint8_t sc[8], mn[8];
                r->d[b] = f16_to_f32(blk);
                r->m[b] = f16_to_f32(blk + 2);
                k_scales(blk + 4, sc, mn);
                for (int j = 0; j < 8; ++j) {
                    r->sc[16 * b + 2 * j] = r->sc[16 * b + 2 * j + 1] = sc[j];
                    r->mn[16 * b + 2 * j] = r->mn[16 * b + 2 * j + 1] = mn[j];
                    for (int l = 0; l < 32; ++l) {
                        int q = (qs[32 * (j / 2) + l] >> ((j & 1) * 4)) & 15;
                        if (five) q |= ((qh[l] >> j) & 1) << 4;
                        r->q[256 * b + 32 * j + l] = (int8_t)q;
                    }
                }
                break;
            }
            case Q6_K: {
                const uint8_t *blk = w + b * 210, *ql = blk, *qh = blk + 128;
                r->d[b] = f16_to_f32(blk + 208);
                r->m[b] = 0.0f;
                for (int g = 0; g < 16; ++g) {
                    r->sc[16 * b + g] = ((const int8_t *)(blk + 192))[g];
                    r->mn[16 * b + g] = 0;
                }
                for (int h = 0; h < 2; ++h)
                    for (int kk = 0; kk < 4; ++kk)
                        for (int l = 0; l < 32; ++l) {
                            const int q = ((ql[64 * h + 32 * (kk & 1) + l] >> (4 * (kk >> 1))) & 15)
                                          | ((qh[32 * h + l] >> (2 * kk)) & 3) << 4;
                            r->q[256 * b + 128 * h + 32 * kk + l] = (int8_t)(q - 32);
                        }
                break;
            }
            default: break;
        }
    }
}

static float dot_row32_portable(const wrow_t *w, const xblock32 *x, int64_t nb)
{
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        int s = 0;
        for (int l = 0; l < 32; ++l) s += w->q[32 * b + l] * x[b].q[l];
        acc += w->d[b] * x[b].d * (float)s + w->m[b] * x[b].s;
    }
    return acc;
}

static float dot_rowk_portable(const wrow_t *w, const xblockk *x, int64_t nb)
{
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        int isum = 0, msum = 0;
        for (int g = 0; g < 16; ++g) {
            int s = 0;
            for (int l = 0; l < 16; ++l) s += w->q[256 * b + 16 * g + l] * x[b].q[16 * g + l];
            isum += w->sc[16 * b + g] * s;
            msum += w->mn[16 * b + g] * x[b].bsums[g];
        }
        acc += w->d[b] * x[b].d * (float)isum - w->m[b] * x[b].d * (float)msum;
    }
    return acc;
}

/* Columns [o0, o1) of y for all m rows, each weight row decoded once. Returns 0 or ERR_MEMORY. */
static int matmul_portable(int64_t type, const uint8_t *w, int64_t o0, int64_t o1, int64_t k, const uint8_t *xq,
                           int64_t xstride, int64_t m, float *y, int64_t ldy)
{
    const int qb = block_values(type);
    const int64_t nb = k / qb, row_bytes = nb * block_bytes(type);
    wrow_t r;
    void *mem = malloc((size_t)(k + nb * (2 * sizeof(float) + 32 * sizeof(int16_t))));
    if (mem == NULL) return ERR_MEMORY;
    r.d = (float *)mem;
    r.m = r.d + nb;
    r.sc = (int16_t *)(r.m + nb);
    r.mn = r.sc + 16 * nb;
    r.q = (int8_t *)(r.mn + 16 * nb);
    for (int64_t o = o0; o < o1; ++o) {
        decode_row_portable(type, w + o * row_bytes, nb, &r);
        for (int64_t i = 0; i < m; ++i)
            y[i * ldy + o] = qb == 32 ? dot_row32_portable(&r, (const xblock32 *)(xq + i * xstride), nb)
                                      : dot_rowk_portable(&r, (const xblockk *)(xq + i * xstride), nb);
    }
    free(mem);
    return 0;
}

/* ---------------------------------------------------------------------------------------------- */
/* AVX-512 VNNI path                                                                                */
#if QUANT_ISA == 3

#define R_TILE 8 /* rows per tile (K types) */
#define R16 12   /* rows per tile (32-value types; COLS16_ROWS lists them) */

/* The 32-value types, 16 output columns at a time: the same block of 16 weight rows decoded into
 * one tile of 8 vectors, vector s holding quants [4s, 4s + 4) of the 16 rows (row r in 32-bit lane
 * r), as unsigned bytes (Q4_0, Q4_1: the nibbles; Q8_0: q + 128), and the rows' scales d (and Q4_1's
 * mins m) as vectors. A row of x then takes 8 vpdpbusd per block, each with 4 of its quants
 * broadcast, for the 16 columns' integer dot products (started at x's offset term c, which takes out
 * Q4_0's 8 and Q8_0's 128 exactly), one conversion and two multiply-adds: y += float(dot) * (d * x.d)
 * (+ m * x.s for Q4_1). Every column is one lane of these vectors, whatever the rows of x, the tile
 * or the thread. */
typedef struct {
    __m512i q[8];
    __m512 d, m;
} wtile16;
typedef int32_t int32_alias __attribute__((may_alias, aligned(4)));

/* T[s] (s < 4), 32-bit lane r: the 32-bit word s of the 16 bytes at p + r * rb, for r < 16. */
INLINE void transpose16x4(const uint8_t *p, int64_t rb, __m512i T[4])
{
    __m512i z[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) { /* 128-bit lane l of z[j]: row 4l + j */
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p + j * rb)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + (4 + j) * rb)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + (8 + j) * rb)), 2);
        z[j] = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(p + (12 + j) * rb)), 3);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    T[0] = _mm512_unpacklo_epi64(t0, t2);
    T[1] = _mm512_unpackhi_epi64(t0, t2);
    T[2] = _mm512_unpacklo_epi64(t1, t3);
    T[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* The tile of the blocks at p + r * rb (r < 16); ``rows`` holds r * rb in lane r. Prefetches the
 * 16 * (block bytes) at pf: the next group's rows are read one block of each at a time, 16 streams
 * that the hardware prefetchers do not follow well, so each block of a group fetches the same share
 * of the next group's bytes (contiguous), into L2 (a whole group does not fit L1 beside the tiles:
 * measured 20.1 GB/s into L1, 22.4 into L2, 1B Q8_0 batch-1 decode, two threads). */
INLINE void decode_tile16(const int type, const uint8_t *p, int64_t rb, __m512i rows, wtile16 *t, const uint8_t *pf)
{
    const int bb = type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34;
    for (int off = 0; off < 16 * bb; off += 64) _mm_prefetch((const char *)pf + off, _MM_HINT_T1);
    const __m512i head = _mm512_i32gather_epi32(rows, p, 1); /* d, and m for Q4_1 */
    t->d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
    t->m = type == Q4_1 ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16))) : _mm512_setzero_ps();
    __m512i T[4];
    if (type == Q8_0) {
        const __m512i sign = _mm512_set1_epi8((char)0x80);
        transpose16x4(p + 2, rb, T);
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s) t->q[s] = _mm512_xor_si512(T[s], sign);
        transpose16x4(p + 18, rb, T);
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s) t->q[4 + s] = _mm512_xor_si512(T[s], sign);
    } else {
        const __m512i m0f = _mm512_set1_epi8(15);
        transpose16x4(p + (type == Q4_1 ? 4 : 2), rb, T);
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s) {
            t->q[s] = _mm512_and_si512(T[s], m0f);
            t->q[4 + s] = _mm512_and_si512(_mm512_srli_epi16(T[s], 4), m0f);
        }
    }
}

/* R rows of x (block records, ``xs`` blocks apart) times the 16 weight rows at w (``rb`` bytes apart,
 * ``rows`` as above) over nb blocks, into y[i * ldy + lane] for the lanes in ``mask``; the tiles are
 * decoded block by block here, or taken from ``tiles`` (decoded by decode_tile16). */
INLINE void cols16_avx512(const int R, const int type, const int from_tiles, const uint8_t *w, int64_t rb,
                          __m512i rows, const uint8_t *next, const wtile16 *tiles, int64_t nb, const xblock16 *x,
                          int64_t xs, float *y, int64_t ldy, __mmask16 mask)
{
    const int bb = type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34;
    __m512 acc[R16];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        wtile16 t;
        if (from_tiles)
            t = tiles[b];
        else
            decode_tile16(type, w + b * bb, rb, rows, &t, next + 16 * bb * b);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
            const xblock16 *xb = x + i * xs + b;
            const int32_alias *xq = (const int32_alias *)xb->q; /* (broadcast straight from memory) */
            __m512i dot = type == Q4_1 ? _mm512_setzero_si512() : _mm512_set1_epi32(xb->c);
            __m512i dot2 = _mm512_setzero_si512(); /* (two chains of vpdpbusd) */
#pragma GCC unroll 8
            for (int s = 0; s < 8; s += 2) {
                dot = _mm512_dpbusd_epi32(dot, t.q[s], _mm512_set1_epi32(xq[s]));
                dot2 = _mm512_dpbusd_epi32(dot2, t.q[s + 1], _mm512_set1_epi32(xq[s + 1]));
            }
            dot = _mm512_add_epi32(dot, dot2);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(t.d, _mm512_set1_ps(xb->d)), acc[i]);
            if (type == Q4_1) acc[i] = _mm512_fmadd_ps(t.m, _mm512_set1_ps(xb->s), acc[i]);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) _mm512_mask_storeu_ps(y + i * ldy, mask, acc[i]);
}

#define COLS16_R(T, F, R) \
    case R: cols16_avx512(R, T, F, w, rb, rows, next, tiles, nb, x, xs, y, ldy, mask); break;
#define COLS16_ROWS(T, F)                                                                         \
    switch (nrows) {                                                                              \
        COLS16_R(T, F, 1) COLS16_R(T, F, 2) COLS16_R(T, F, 3) COLS16_R(T, F, 4) COLS16_R(T, F, 5)  \
        COLS16_R(T, F, 6) COLS16_R(T, F, 7) COLS16_R(T, F, 8) COLS16_R(T, F, 9) COLS16_R(T, F, 10) \
        COLS16_R(T, F, 11) COLS16_R(T, F, 12) default: break;                                     \
    }

/* ``nrows`` (<= R16) rows of x times 16 weight rows (see cols16_avx512). */
static __attribute__((noinline)) void tile16(int nrows, int64_t type, int from_tiles, const uint8_t *w, int64_t rb,
                                             __m512i rows, const uint8_t *next, const wtile16 *tiles, int64_t nb,
                                             const xblock16 *x, int64_t xs, float *y, int64_t ldy, __mmask16 mask)
{
    switch (type * 2 + (from_tiles != 0)) {
        case 2 * Q4_0: COLS16_ROWS(Q4_0, 0) break;
        case 2 * Q4_0 + 1: COLS16_ROWS(Q4_0, 1) break;
        case 2 * Q4_1: COLS16_ROWS(Q4_1, 0) break;
        case 2 * Q4_1 + 1: COLS16_ROWS(Q4_1, 1) break;
        case 2 * Q8_0: COLS16_ROWS(Q8_0, 0) break;
        case 2 * Q8_0 + 1: COLS16_ROWS(Q8_0, 1) break;
        default: break;
    }
}

static __attribute__((noinline)) void decode_tiles16(int64_t type, const uint8_t *w, int64_t rb, __m512i rows,
                                                     const uint8_t *next, int64_t nb, wtile16 *tiles)
{
    const int bb = type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34;
    switch (type) {
        case Q4_0:
            for (int64_t b = 0; b < nb; ++b) decode_tile16(Q4_0, w + b * bb, rb, rows, tiles + b, next + 16 * bb * b);
            break;
        case Q4_1:
            for (int64_t b = 0; b < nb; ++b) decode_tile16(Q4_1, w + b * bb, rb, rows, tiles + b, next + 16 * bb * b);
            break;
        case Q8_0:
            for (int64_t b = 0; b < nb; ++b) decode_tile16(Q8_0, w + b * bb, rb, rows, tiles + b, next + 16 * bb * b);
            break;
        default: break;
    }
}

/* Columns [o0, o1) of y (o0 a multiple of 16) for a 32-value type: per group of 16 weight rows
 * (the last one zero-padded in a copy when n is not a multiple of 16), up to R16 rows of x with the
 * tiles decoded on the way, or, for more rows, the group's tiles decoded once into scratch and every
 * tile of rows of x taken over them. Returns 0 or ERR_MEMORY. */
static int matmul_cols16(int64_t type, const uint8_t *w, int64_t o0, int64_t o1, int64_t k, const uint8_t *xq,
                         int64_t xstride, int64_t m, float *y, int64_t ldy)
{
    const int64_t nb = k / 32, rb = nb * block_bytes(type), xs = xstride / (int64_t)sizeof(xblock16);
    const xblock16 *x = (const xblock16 *)xq;
    wtile16 *tiles = NULL;
    uint8_t *pad = NULL;
    if (m > R16 && (tiles = aligned_alloc(64, (size_t)nb * sizeof(wtile16))) == NULL) return ERR_MEMORY;
    if ((o1 - o0) % 16 && (pad = calloc(16, (size_t)rb)) == NULL) {
        free(tiles);
        return ERR_MEMORY;
    }
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)rb));
    const int64_t ntiles = (m + R16 - 1) / R16;
    for (int64_t o = o0; o < o1; o += 16) {
        const uint8_t *wg = w + o * rb, *next = o + 16 < o1 ? wg + 16 * rb : wg; /* to prefetch */
        const int64_t nc = o1 - o < 16 ? o1 - o : 16;
        if (nc < 16) {
            memcpy(pad, wg, (size_t)(nc * rb));
            wg = pad;
        }
        const __mmask16 mask = (__mmask16)((1u << nc) - 1);
        if (tiles == NULL)
            tile16((int)m, type, 0, wg, rb, rows, next, NULL, nb, x, xs, y + o, ldy, mask);
        else {
            decode_tiles16(type, wg, rb, rows, next, nb, tiles);
            for (int64_t t = 0; t < ntiles; ++t) {
                const int64_t r0 = m * t / ntiles, r1 = m * (t + 1) / ntiles; /* balanced tile sizes */
                tile16((int)(r1 - r0), type, 1, wg, rb, rows, next, tiles, nb, x + r0 * xs, xs, y + r0 * ldy + o, ldy,
                       mask);
            }
        }
    }
    free(pad);
    free(tiles);
    return 0;
}

/* A K block decoded for 64-value chunks: quants (unsigned), the 16-bit scale of each pair of values
 * (the lanes of vpmaddubsw's output), the per-16-values mins (Q4_K, Q5_K) or scales (Q6_K) for x's
 * block sums, d, and the factor of the mins term (-dmin; Q6_K: its -32 offset, applied exactly). */
typedef struct {
    __m512i q[4], s[4];
    __m256i mins;
    float d, c;
} kblock512;

INLINE __m512i chunk_scales(__m512i s16, int c, int per) /* lane i: s16[per * c + i / (32 / per)] */
{
    const __m512i lane = _mm512_setr_epi32(0x00010000, 0x00030002, 0x00050004, 0x00070006, 0x00090008, 0x000b000a,
                                           0x000d000c, 0x000f000e, 0x00110010, 0x00130012, 0x00150014, 0x00170016,
                                           0x00190018, 0x001b001a, 0x001d001c, 0x001f001e);
    const __m512i idx = _mm512_add_epi16(_mm512_set1_epi16((short)(per * c)),
                                         _mm512_srli_epi16(lane, per == 2 ? 4 : 3));
    return _mm512_permutexvar_epi16(idx, s16);
}

INLINE void decode_k512(const int type, const uint8_t *b, kblock512 *k)
{
    if (type == Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        for (int h = 0; h < 2; ++h) {
            const __m512i l = _mm512_loadu_si512(ql + 64 * h);
            const __m512i hz = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qh + 32 * h)));
            const __m512i m30 = _mm512_set1_epi8(0x30), m0f = _mm512_set1_epi8(15);
            const __m512i up = _mm512_sllv_epi16(hz, _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1));
            const __m512i dn = _mm512_srlv_epi16(hz, _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1));
            k->q[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m0f), _mm512_and_si512(up, m30));
            k->q[2 * h + 1] =
                _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m0f), _mm512_and_si512(dn, m30));
        }
        const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
        for (int c = 0; c < 4; ++c) k->s[c] = chunk_scales(_mm512_castsi256_si512(sc), c, 4);
        k->mins = sc;
        k->d = f16_to_f32(b + 208);
        k->c = 0.0f;
        return;
    }
    const int five = type == Q5_K;
    const uint8_t *qs = b + (five ? 48 : 16);
    uint64_t sc8, mn8;
    k_scales_packed(b + 4, &sc8, &mn8);
    for (int c = 0; c < 4; ++c) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
        k->q[c] = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1),
                                   _mm512_set1_epi8(15));
    }
    if (five) {
        const __m512i hz = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 16)));
        for (int c = 0; c < 4; ++c) {
            const __m512i bit = _mm512_inserti64x4(_mm512_set1_epi8((char)(1 << (2 * c))),
                                                   _mm256_set1_epi8((char)(1 << (2 * c + 1))), 1);
            k->q[c] = _mm512_mask_add_epi8(k->q[c], _mm512_test_epi8_mask(hz, bit), k->q[c], _mm512_set1_epi8(16));
        }
    }
    const __m512i s16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)sc8)));
    for (int c = 0; c < 4; ++c) k->s[c] = chunk_scales(s16, c, 2);
    const __m256i m16 = _mm256_castsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)mn8)));
    k->mins = _mm256_permutexvar_epi16(_mm256_setr_epi16(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), m16);
    k->d = f16_to_f32(b);
    k->c = -f16_to_f32(b + 2);
}

/* R rows of x (K block records, ``xs`` blocks apart) times weight rows [0, n) of a K type:
 * y[i * ldy + o]. Per block, weight row and row of x: four vpmaddubsw + vpdpwssd (the sub-block
 * scales applied in 16 bits), the mins' term from x's block sums (one vpmaddwd), two multiply-adds. */
INLINE void colsk_avx512(const int R, const int type, const uint8_t *w, int64_t row_bytes, int64_t n, float *y,
                         int64_t ldy, int64_t nb, const xblockk *x, int64_t xs)
{
    const int bb = type == Q4_K ? 144 : type == Q5_K ? 176 : 210;
    for (int64_t o = 0; o < n; ++o) {
        __m512 acc[R_TILE];
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            kblock512 k;
            const uint8_t *blk = w + o * row_bytes + b * bb;
            prefetch_ahead(blk, bb);
            decode_k512(type, blk, &k);
#pragma GCC unroll 8
            for (int i = 0; i < R; ++i) {
                const xblockk *xb = x + i * xs + b;
                __m512i isum = _mm512_setzero_si512();
#pragma GCC unroll 4
                for (int c = 0; c < 4; ++c)
                    isum = _mm512_dpwssd_epi32(isum, _mm512_maddubs_epi16(k.q[c], _mm512_loadu_si512(xb->q + 64 * c)),
                                               k.s[c]);
                const __m256i msum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), k.mins);
                if (type == Q6_K) {
                    isum = _mm512_sub_epi32(isum, _mm512_slli_epi32(_mm512_zextsi256_si512(msum), 5));
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(k.d * xb->d), acc[i]);
                } else {
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_set1_ps(k.d * xb->d), acc[i]);
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_zextsi256_si512(msum)),
                                             _mm512_set1_ps(k.c * xb->d), acc[i]);
                }
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) y[i * ldy + o] = _mm512_reduce_add_ps(acc[i]);
    }
}

/* A tile with R a compile-time constant, so that the sums live in registers. */
#define TILE_R(F, T, R, ...) \
    case R: F(R, T, w, row_bytes, n, y, __VA_ARGS__); break;
#define TILE_ROWS(F, T, ...)                                                                   \
    switch (rows) {                                                                            \
        TILE_R(F, T, 1, __VA_ARGS__) TILE_R(F, T, 2, __VA_ARGS__) TILE_R(F, T, 3, __VA_ARGS__) \
        TILE_R(F, T, 4, __VA_ARGS__) TILE_R(F, T, 5, __VA_ARGS__) TILE_R(F, T, 6, __VA_ARGS__) \
        TILE_R(F, T, 7, __VA_ARGS__) TILE_R(F, T, 8, __VA_ARGS__) default: break;              \
    }

static int64_t simd_scratch_floats(int64_t k)
{
    (void)k;
    return 0;
}

/* ``rows`` rows of x times ``n`` weight rows from ``w``. */
static __attribute__((noinline)) void tile_simd(int rows, int64_t type, const uint8_t *w, int64_t row_bytes,
                                                int64_t n, int64_t k, const uint8_t *x, int64_t xstride, float *y,
                                                int64_t ldy, float *scratch)
{
    (void)scratch;
    const xblockk *xk = (const xblockk *)x;
    const int64_t sk = xstride / (int64_t)sizeof(xblockk);
    switch (type) {
        case Q4_K: TILE_ROWS(colsk_avx512, Q4_K, ldy, k / 256, xk, sk) break;
        case Q5_K: TILE_ROWS(colsk_avx512, Q5_K, ldy, k / 256, xk, sk) break;
        case Q6_K: TILE_ROWS(colsk_avx512, Q6_K, ldy, k / 256, xk, sk) break;
        default: break;
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* AVX2 path (AVX-VNNI where there)                                                                 */
#elif QUANT_ISA >= 1

#define R_TILE 4 /* rows per tile */

INLINE __m256i dot_u8s8(__m256i u, __m256i s) /* 8 x int32: sums of 4 products of u8 * s8 */
{
#if QUANT_ISA == 2
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

INLINE __m256i dot_s16_acc(__m256i acc, __m256i a, __m256i b) /* acc + pair sums of a * b (int16) */
{
#if QUANT_ISA == 2
    return _mm256_dpwssd_avx_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

INLINE float hsum256(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* R rows of x (block records, ``xs`` blocks apart) times weight rows [0, n) (``row_bytes`` apart)
 * of a 32-value type: y[i * ldy + o]. */
INLINE void cols32_avx2(const int R, const int type, const uint8_t *w, int64_t row_bytes, int64_t n, float *y,
                        int64_t ldy, int64_t nb, const xblock32 *x, int64_t xs)
{
    const int bb = type == Q4_0 ? 18 : type == Q4_1 ? 20 : 34;
    for (int64_t o = 0; o < n; ++o) {
        __m256 acc[R_TILE];
        float accs[R_TILE];
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) {
            acc[i] = _mm256_setzero_ps();
            accs[i] = 0.0f;
        }
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = w + o * row_bytes + b * bb;
            const float d = f16_to_f32(blk);
            __m256i wq, wabs = _mm256_setzero_si256();
            float m = 0.0f;
            if (type == Q8_0) {
                wq = _mm256_loadu_si256((const __m256i *)(blk + 2));
                wabs = _mm256_abs_epi8(wq);
            } else {
                const __m128i qs = _mm_loadu_si128((const __m128i *)(blk + (type == Q4_1 ? 4 : 2)));
                wq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(15));
                m = type == Q4_1 ? f16_to_f32(blk + 2) : -8.0f * d;
            }
#pragma GCC unroll 4
            for (int i = 0; i < R; ++i) {
                const xblock32 *xb = x + i * xs + b;
                const __m256i xq = _mm256_loadu_si256((const __m256i *)xb->q);
                /* Q8_0: |w| times x with w's sign, so that no pair sum of vpmaddubsw saturates */
                const __m256i dot = type == Q8_0 ? dot_u8s8(wabs, _mm256_sign_epi8(xq, wq)) : dot_u8s8(wq, xq);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * xb->d), acc[i]);
                if (type != Q8_0) /* (an fma intrinsic: the same rounding in every tile shape) */
                    accs[i] = _mm_cvtss_f32(_mm_fmadd_ss(_mm_set_ss(m), _mm_set_ss(xb->s), _mm_set_ss(accs[i])));
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) y[i * ldy + o] = hsum256(acc[i]) + accs[i];
    }
}

/* A K block decoded: quants (unsigned), the 16-bit scale of each pair of values, the per-16-values
 * mins (Q4_K, Q5_K) or scales (Q6_K), d and the mins' factor (see kblock512 above). */
typedef struct {
    uint8_t q[256];
    int16_t s[128];
    int16_t mins[16];
    float d, c;
} kblock256;

INLINE void decode_k256(const int type, const uint8_t *b, kblock256 *k)
{
    const __m256i m0f = _mm256_set1_epi8(15);
    if (type == Q6_K) {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        for (int h = 0; h < 2; ++h) {
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            for (int kk = 0; kk < 4; ++kk) {
                __m256i l = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32 * (kk & 1)));
                if (kk >= 2) l = _mm256_srli_epi16(l, 4);
                const __m256i hi =
                    _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * kk)), _mm256_set1_epi8(3));
                _mm256_storeu_si256((__m256i *)(k->q + 128 * h + 32 * kk),
                                    _mm256_or_si256(_mm256_and_si256(l, m0f), _mm256_slli_epi16(hi, 4)));
            }
        }
        for (int g = 0; g < 16; ++g) {
            _mm_storeu_si128((__m128i *)(k->s + 8 * g), _mm_set1_epi16(sc[g]));
            k->mins[g] = sc[g];
        }
        k->d = f16_to_f32(b + 208);
        k->c = 0.0f;
        return;
    }
    const int five = type == Q5_K;
    const uint8_t *qs = b + (five ? 48 : 16);
    uint64_t sc8, mn8;
    k_scales_packed(b + 4, &sc8, &mn8);
    const __m256i hb = five ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * (j / 2)));
        __m256i q = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(raw, 4) : raw, m0f);
        if (five) {
            const __m256i bit = _mm256_set1_epi8((char)(1 << j));
            q = _mm256_or_si256(q, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(hb, bit), bit),
                                                    _mm256_set1_epi8(16)));
        }
        _mm256_storeu_si256((__m256i *)(k->q + 32 * j), q);
        _mm256_storeu_si256((__m256i *)(k->s + 16 * j), _mm256_set1_epi16((short)((sc8 >> (8 * j)) & 0xff)));
        k->mins[2 * j] = k->mins[2 * j + 1] = (int16_t)((mn8 >> (8 * j)) & 0xff);
    }
    k->d = f16_to_f32(b);
    k->c = -f16_to_f32(b + 2);
}

/* R rows of x (K block records, ``xs`` blocks apart) times weight rows [0, n) of a K type:
 * y[i * ldy + o]. */
INLINE void colsk_avx2(const int R, const int type, const uint8_t *w, int64_t row_bytes, int64_t n, float *y,
                       int64_t ldy, int64_t nb, const xblockk *x, int64_t xs)
{
    const int bb = type == Q4_K ? 144 : type == Q5_K ? 176 : 210;
    kblock256 k;
    for (int64_t o = 0; o < n; ++o) {
        __m256 acc[R_TILE];
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            const uint8_t *blk = w + o * row_bytes + b * bb;
            prefetch_ahead(blk, bb);
            decode_k256(type, blk, &k);
            const __m256i mins = _mm256_loadu_si256((const __m256i *)k.mins);
#pragma GCC unroll 4
            for (int i = 0; i < R; ++i) {
                const xblockk *xb = x + i * xs + b;
                __m256i isum = _mm256_setzero_si256();
#pragma GCC unroll 8
                for (int c = 0; c < 8; ++c) {
                    const __m256i p = _mm256_maddubs_epi16(_mm256_loadu_si256((const __m256i *)(k.q + 32 * c)),
                                                           _mm256_loadu_si256((const __m256i *)(xb->q + 32 * c)));
                    isum = dot_s16_acc(isum, p, _mm256_loadu_si256((const __m256i *)(k.s + 16 * c)));
                }
                const __m256i msum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)xb->bsums), mins);
                if (type == Q6_K) {
                    isum = _mm256_sub_epi32(isum, _mm256_slli_epi32(msum, 5));
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(k.d * xb->d), acc[i]);
                } else {
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_set1_ps(k.d * xb->d), acc[i]);
                    acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_set1_ps(k.c * xb->d), acc[i]);
                }
            }
        }
#pragma GCC unroll 4
        for (int i = 0; i < R; ++i) y[i * ldy + o] = hsum256(acc[i]);
    }
}

/* A tile with R a compile-time constant, so that the sums live in registers. */
#define TILE_R(F, T, R, ...) \
    case R: F(R, T, w, row_bytes, n, y, __VA_ARGS__); break;
#define TILE_ROWS(F, T, ...)                                                                   \
    switch (rows) {                                                                            \
        TILE_R(F, T, 1, __VA_ARGS__) TILE_R(F, T, 2, __VA_ARGS__) TILE_R(F, T, 3, __VA_ARGS__) \
        TILE_R(F, T, 4, __VA_ARGS__) default: break;                                           \
    }

static int64_t simd_scratch_floats(int64_t k)
{
    (void)k;
    return 0;
}

/* ``rows`` rows of x times ``n`` weight rows from ``w``. */
static __attribute__((noinline)) void tile_simd(int rows, int64_t type, const uint8_t *w, int64_t row_bytes,
                                                int64_t n, int64_t k, const uint8_t *x, int64_t xstride, float *y,
                                                int64_t ldy, float *scratch)
{
    (void)scratch;
    const xblock32 *x32 = (const xblock32 *)x;
    const xblockk *xk = (const xblockk *)x;
    const int64_t s32 = xstride / (int64_t)sizeof(xblock32), sk = xstride / (int64_t)sizeof(xblockk);
    switch (type) {
        case Q4_0: TILE_ROWS(cols32_avx2, Q4_0, ldy, k / 32, x32, s32) break;
        case Q4_1: TILE_ROWS(cols32_avx2, Q4_1, ldy, k / 32, x32, s32) break;
        case Q8_0: TILE_ROWS(cols32_avx2, Q8_0, ldy, k / 32, x32, s32) break;
        case Q4_K: TILE_ROWS(colsk_avx2, Q4_K, ldy, k / 256, xk, sk) break;
        case Q5_K: TILE_ROWS(colsk_avx2, Q5_K, ldy, k / 256, xk, sk) break;
        case Q6_K: TILE_ROWS(colsk_avx2, Q6_K, ldy, k / 256, xk, sk) break;
        default: break;
    }
}
#endif /* QUANT_ISA */

#if QUANT_ISA > 0
/* Output columns per pass over a tile's rows: the weight rows of a pass stay in cache while later
 * tiles of rows reuse them. */
static int64_t columns_per_pass(int64_t row_bytes)
{
    const int64_t c = 16384 / (row_bytes > 0 ? row_bytes : 1);
    return c > 0 ? c : 1;
}

/* Columns [o0, o1) of y: passes of columns_per_pass columns, each over all tiles of rows. Returns 0
 * or ERR_MEMORY. */
static int matmul_simd(int64_t type, const uint8_t *w, int64_t o0, int64_t o1, int64_t k, const uint8_t *xq,
                       int64_t xstride, int64_t m, float *y, int64_t ldy)
{
    const int64_t row_bytes = k / block_values(type) * block_bytes(type);
    float *scratch = NULL;
    if (simd_scratch_floats(k) > 0) {
        scratch = aligned_alloc(64, (size_t)simd_scratch_floats(k) * sizeof(float));
        if (scratch == NULL) return ERR_MEMORY;
        memset(scratch, 0, (size_t)simd_scratch_floats(k) * sizeof(float));
    }
    const int64_t tiles = (m + R_TILE - 1) / R_TILE, cols = tiles > 1 ? columns_per_pass(row_bytes) : o1 - o0;
    for (int64_t c0 = o0; c0 < o1; c0 += cols) {
        const int64_t c1 = c0 + cols < o1 ? c0 + cols : o1;
        for (int64_t t = 0; t < tiles; ++t) {
            const int64_t r0 = m * t / tiles, r1 = m * (t + 1) / tiles; /* balanced tile sizes */
            /* Tiles of up to 4 rows loop over the weight rows inside the specialised code (its setup
             * shared); larger ones are called once per weight row, which leaves the compiler more
             * registers for the rows (measured: ~10% faster at 8 rows). */
            if (r1 - r0 <= 4)
                tile_simd((int)(r1 - r0), type, w + c0 * row_bytes, row_bytes, c1 - c0, k, xq + r0 * xstride, xstride,
                          y + r0 * ldy + c0, ldy, scratch);
            else
                for (int64_t o = c0; o < c1; ++o)
                    tile_simd((int)(r1 - r0), type, w + o * row_bytes, row_bytes, 1, k, xq + r0 * xstride, xstride,
                              y + r0 * ldy + o, ldy, scratch);
        }
    }
    free(scratch);
    return 0;
}
#endif

/* ---------------------------------------------------------------------------------------------- */
/* Entry points                                                                                     */

static int64_t quant_matmul(int64_t type, const void *w, int64_t n, int64_t k, const float *x, int64_t m, int64_t ldx,
                            float *y, int64_t ldy, int simd)
{
    const int qb = block_values(type);
    if (!qb) return ERR_TYPE;
    if (n < 0 || k < 0 || m < 0 || k % qb) return ERR_SHAPE;
    if (m == 0 || n == 0) return 0;
    if (k == 0) {
        for (int64_t i = 0; i < m; ++i) memset(y + i * ldy, 0, sizeof(float) * (size_t)n);
        return 0;
    }
#if QUANT_ISA == 0
    simd = 0;
#endif
    const int64_t xstride = xrow_bytes(type, k, simd);
    const size_t size = (size_t)(m * xstride + 63) / 64 * 64;
    uint8_t *xq = aligned_alloc(64, size);
    if (xq == NULL) return ERR_MEMORY;
    int err = 0;
#pragma omp parallel if (m * n * k >= 32768)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < m; ++i) quantize_row(type, x + i * ldx, k, simd, xq + i * xstride);
        /* (the loop's barrier: every row is quantized before any product starts) */
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        /* (AVX-512, 32-value types: ranges of whole groups of 16 columns) */
        const int64_t unit = QUANT_ISA == 3 && simd && qb == 32 ? 16 : 1, units = (n + unit - 1) / unit;
        const int64_t u0 = unit * (units * t / nt), u1 = unit * (units * (t + 1) / nt);
        const int64_t o0 = u0 < n ? u0 : n, o1 = u1 < n ? u1 : n;
        if (o1 > o0) {
            int rc;
#if QUANT_ISA == 3
            if (simd && qb == 32)
                rc = matmul_cols16(type, (const uint8_t *)w, o0, o1, k, xq, xstride, m, y, ldy);
            else
#endif
#if QUANT_ISA > 0
            if (simd)
                rc = matmul_simd(type, (const uint8_t *)w, o0, o1, k, xq, xstride, m, y, ldy);
            else
#endif
                rc = matmul_portable(type, (const uint8_t *)w, o0, o1, k, xq, xstride, m, y, ldy);
            if (rc) {
#pragma omp atomic write
                err = rc;
            }
        }
    }
    free(xq);
    return err;
}

/* y[m, n] (row stride ldy) = x[m, k] (row stride ldx) @ W^T, W the [n, k] weight of GGML type ``type``
 * in its GGUF block layout. Returns 0, ERR_TYPE (type not supported), ERR_SHAPE (k not a multiple of
 * the block's values) or ERR_MEMORY. */
int64_t quant_matmul_f32(int64_t type, const void *w, int64_t n, int64_t k, const float *x, int64_t m, int64_t ldx,
                         float *y, int64_t ldy)
{
    return quant_matmul(type, w, n, k, x, m, ldx, y, ldy, 1);
}

/* The same through the portable C path, whatever the CPU (for tests). */
int64_t quant_matmul_f32_portable(int64_t type, const void *w, int64_t n, int64_t k, const float *x, int64_t m,
                                  int64_t ldx, float *y, int64_t ldy)
{
    return quant_matmul(type, w, n, k, x, m, ldx, y, ldy, 0);
}

/* The path quant_matmul_f32 takes: 0 portable C, 1 AVX2, 2 AVX2 with AVX-VNNI, 3 AVX-512 VNNI. */
int64_t quant_kernel_isa(void)
{
    return QUANT_ISA;
}
