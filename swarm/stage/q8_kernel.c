/* swarm's 8-bit group matrix kernel for CPUs: y = x W^T (+ b), with W in 8-bit levels per group of 32 inputs and x
 * quantized to 8 bits per group of 32 as it comes in -- the scheme of llama.cpp's Q8_0 x Q8_0 dot products, here for
 * the GGUF types whose blocks are exact on an 8-bit grid: Q8_0, Q5_0, Q5_1, Q5_K and Q6_K (swarm/stage/gguf_q8.py
 * repacks them; swarm/stage/q8_kernel.py builds and loads this file, as int4_kernel.py does int4_kernel.c).
 *
 * W (n outputs x k inputs, k a multiple of 32): level q held as the unsigned u = q + zero (so that the byte dot
 * product with the signed activations is VNNI's unsigned-by-signed one; zero 128 for Q8_0's bytes), a byte each or, at
 * 5 and 6 bits, in planes (row_bytes) unpacked to bytes in registers; a weight is s q (+ z), s and z as exact as the
 * file's (its fp16 d, m as halves; Q6_K's d * sc and Q5_K's d * sc and dmin * m as int8 sub-scales and a half per 8,
 * multiplied in float32 a block of outputs at a time -- exact). The byte layout below is u's order either way.
 * Where `halves`, each group has two scales, one for its first 16 inputs and one for its last 16 (Q6_K's sub-blocks
 * of 16). An output's inputs
 * come in blocks of 16 groups (512 inputs), then a tail of the groups left over where k is not a multiple of 512:
 *  - a block is 8 vectors of 64 bytes, vector v holding inputs 4v..4v+3 of each of its groups (group g in bytes
 *    4g..4g+3, one 32-bit lane). The VNNI dot product of a vector with the activations in the same order sums four
 *    products per lane, so vectors 0..3 sum each group's first 16 products in its own lane, 4..7 its last 16, in
 *    integers, and a block needs one conversion to float and one multiply-add per half and row;
 *  - the tail's groups are in their own order, 32 bytes each, taken two at a time (one 64-byte vector): its lanes'
 *    sums are folded in integers into the two groups' halves, then converted. Laid out as blocks, a tail of 2 groups
 *    (576 = 512 + 64 inputs, SmolLM2's width) cost as much as a whole block: 41 against 34 us a 576 x 1536 product.
 * An output takes k bytes; its scales are `parts` rows of k / 32 floats: the scales (of the first halves, then of the
 * second where `halves`), then the offsets where `offsets`.
 *
 * x (rows x k, float32): each row's groups of 32 quantized alone, d = max|x| / 127, xq = round(x / d), so a row's
 * result never depends on the other rows of the call; xq is laid out as the weights are (place gives where each input
 * goes), and the sum of each half group's xq is kept to undo the weights' + 128:
 *
 *   y = sum over groups and halves of  s d (u . xq - 128 sum(xq))  +  z sum(x)        (u = q + 128)
 *
 * u . xq is VNNI's byte dot product where the CPU has AVX512-VNNI or AVX-VNNI; AVX2 without VNNI multiplies |q| by
 * xq with q's sign (maddubs, as llama.cpp does: 2 x 128 x 127 fits 16 bits); plain C elsewhere. The integer sums are
 * exact on every path. Each output is summed by one thread in a fixed order: the same inputs give the same bits,
 * whatever the thread count and whichever rows share the call. Outputs are split over OpenMP threads.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__AVX2__) || defined(__AVX512F__))
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__)
#define PATH_512 1
#define PATH_NAME "avx512-vnni"
#elif defined(__AVX2__) && defined(__FMA__)
#define PATH_256 1
#if defined(__AVXVNNI__)
#define PATH_NAME "avx2-vnni"
#else
#define PATH_NAME "avx2"
#endif
#else
#define PATH_NAME "generic"
#endif

#define GROUP 32     /* inputs per scale (per two scales where halves) */
#define BLOCK 512    /* inputs of a whole block: 16 groups */
#define OUT_BLOCK 16 /* outputs a thread takes at a time */
#define ROW_TILE 8   /* rows that share one load of the weights */
#define FOUR 4       /* outputs a decode step's row meets at once (AVX512) */
/* "bits" of 5- or 6-bit levels unpacked to a byte each (u below 64, so no sign trick): a prefill's output block is
 * unpacked once and its row tiles read the bytes */
#define WIDENED 7
#define PREFETCH 8   /* outputs ahead whose weights are asked for (int4_kernel.c: the short rows of a decode step) */

const char *swarm_q8_path(void) { return PATH_NAME; }

/* Where input i of a row goes: in a block, vector (i % 32) / 4, its group's lane; in the tail, where it is */
static inline int place(int i, int k) {
    if (i >= k / BLOCK * BLOCK) return i;
    const int b = i / BLOCK * BLOCK, r = i - b;
    return b + 64 * (r % GROUP / 4) + 4 * (r / GROUP) + r % 4;
}

/* One row: xq (k bytes, in place's order), and per group d, sum(x) and the sums of its halves' xq (k / 32 each). */
typedef struct {
    int8_t *xq;
    float *d, *sum;
    int32_t *lo, *hi;
} row_q;

/* Bytes an output's levels take: k where bits is 8; else per 64 inputs (a chunk, padded at the row's end) 32 bytes of
 * nibbles -- byte i the low 4 bits of input i in its low half, of input 32 + i in its high half -- then, per level bit
 * above the fourth, 8 bytes of that bit of the 64 inputs (bit i % 8 of byte i / 8). Inputs are in place's order. */
static inline size_t row_bytes(int k, int bits) {
    return bits >= WIDENED ? (size_t)k : (size_t)(k + 63) / 64 * (size_t)(32 + 8 * (bits - 4));
}

/* u of the input at p (place's order) of one output's levels */
static inline int u_at(const uint8_t *w, int p, int bits) {
    if (bits >= WIDENED) return w[p];
    const uint8_t *c = w + (size_t)(32 + 8 * (bits - 4)) * (size_t)(p / 64);
    const int i = p % 64;
    int u = i < 32 ? (c[i] & 0x0F) : (c[i - 32] >> 4);
    u |= ((c[32 + i / 8] >> (i % 8)) & 1) << 4;
    if (bits == 6) u |= ((c[40 + i / 8] >> (i % 8)) & 1) << 5;
    return u;
}

int swarm_q8_row_bytes(int k, int bits) { return (int)row_bytes(k, bits); }

/* IEEE half h as a float: exact (every half is a float), NaN kept a NaN */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t bits = sign;
    float f;
    if (exp == 0x1F) {
        bits |= 0x7F800000u | (man << 13);
    } else if (exp) {
        bits |= ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: man x 2^-24 */
        f = (float)man * 5.9604644775390625e-08f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    memcpy(&f, &bits, 4);
    return f;
}

/* count scales held as halves (Q8_0's, Q5_0's and Q5_1's fp16 d and m, as the file has them) into floats */
static void halves_to_floats(const uint16_t *h, float *f, size_t count) {
    size_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= count; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < count; i++) f[i] = half_to_float(h[i]);
}

#if defined(PATH_512)
static inline void quantize_group(const float *v, int8_t *q, float *d, float *sum, int32_t *lo, int32_t *hi) {
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    *sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    *d = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(*d > 0.0f ? 1.0f / *d : 0.0f);
    const __m512i top = _mm512_set1_epi32(127), bottom = _mm512_set1_epi32(-127);
    /* rounded to the nearest (even) integer, as rintf */
    const __m512i qa = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), top), bottom);
    const __m512i qb = _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv)), top), bottom);
    *lo = _mm512_reduce_add_epi32(qa);
    *hi = _mm512_reduce_add_epi32(qb);
    _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qb));
}
#else
static inline void quantize_group(const float *v, int8_t *q, float *d, float *sum, int32_t *lo, int32_t *hi) {
    float amax = 0.0f, s = 0.0f;
    for (int i = 0; i < GROUP; i++) {
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
        s += v[i];
    }
    *d = amax / 127.0f;
    *sum = s;
    const float inv = *d > 0.0f ? 1.0f / *d : 0.0f;
    int32_t l = 0, h = 0;
    for (int i = 0; i < GROUP; i++) {
        float r = rintf(v[i] * inv);
        r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
        q[i] = (int8_t)r;
        if (i < GROUP / 2) l += q[i]; else h += q[i];
    }
    *lo = l;
    *hi = h;
}
#endif

/* lo, hi come out times zero: what the byte dot products of the weights' u = q + zero with xq need taken off */
static void quantize_row(const float *x, int k, int zero, row_q r) {
    for (int g = 0; g < k / GROUP; g++) {
        int8_t q[GROUP];
        quantize_group(x + GROUP * g, q, r.d + g, r.sum + g, r.lo + g, r.hi + g);
        r.lo[g] *= zero;
        r.hi[g] *= zero;
        if (GROUP * g >= k / BLOCK * BLOCK) {
            memcpy(r.xq + GROUP * g, q, GROUP);
            continue;
        }
        const int b = GROUP * g / BLOCK * BLOCK, lane = g - b / GROUP;
        for (int v = 0; v < GROUP / 4; v++) memcpy(r.xq + b + 64 * v + 4 * lane, q + 4 * v, 4);
    }
}

/* Where the scales of one output are: its first halves' (or only) scales, its second halves', its offsets */
typedef struct {
    const float *s_lo, *s_hi, *z;
} scales_of;

static inline scales_of scales_at(const float *sz, int groups, int halves, int offsets) {
    scales_of s = {sz, halves ? sz + groups : sz, offsets ? sz + (1 + halves) * groups : NULL};
    return s;
}

#if defined(PATH_512)
/* The sums of four vectors' lanes, at once: halves added, then pairwise sums across the four. Each vector's sum takes
 * the same steps whatever the other three are, so a row's or an output's bits do not depend on its neighbours. */
static inline __m128 sum_four(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    const __m256 all = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
}

/* acc + one block of one row against one output: lo, hi its halves' u . xq (corrected here); s_lo, s_hi, z the
 * output's scales and offsets for the block's groups; the row's d, sums and halves' xq sums from group g on */
static inline __attribute__((always_inline)) __m512 add_block(__m512 acc, __m512i lo, __m512i hi, __m512 s_lo,
                                                               __m512 s_hi, const float *z, __m512 zv, const row_q *x,
                                                               int g, int halves) {
    lo = _mm512_sub_epi32(lo, _mm512_loadu_si512(x->lo + g));
    hi = _mm512_sub_epi32(hi, _mm512_loadu_si512(x->hi + g));
    const __m512 d = _mm512_loadu_ps(x->d + g);
    if (halves) {
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(s_lo, d), acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(s_hi, d), acc);
    } else {
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), _mm512_mul_ps(s_lo, d), acc);
    }
    if (z) acc = _mm512_fmadd_ps(zv, _mm512_loadu_ps(x->sum + g), acc);
    return acc;
}

/* c (1 or 2) numbers from p into lanes 0, 1 (0 beyond) */
static inline __m128 two_f(const float *p, int c) {
    return c == 2 ? _mm_castpd_ps(_mm_load_sd((const double *)p)) : _mm_load_ss(p);
}
static inline __m128i two_i(const int32_t *p, int c) {
    return c == 2 ? _mm_loadl_epi64((const __m128i *)p) : _mm_cvtsi32_si128(*p);
}

/* t + a tail pair of groups g, g + 1 (c = 1: g alone) of one row against one output, their 64 bytes in natural order:
 * dot's lanes are four products each, 0-3 the first group's first half, 4-7 its second, 8-15 the second group's; sc
 * the output's [first lo, first hi, second lo, second hi] scales, z its offsets */
static inline __m128 add_pair(__m128 t, __m512i dot, __m128 sc, const float *zp, __m128 z, const row_q *x, int g,
                              int c) {
    dot = _mm512_add_epi32(dot, _mm512_shuffle_epi32(dot, _MM_PERM_BADC));
    dot = _mm512_add_epi32(dot, _mm512_shuffle_epi32(dot, _MM_PERM_CDAB));
    const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m128i sums = _mm512_castsi512_si128(_mm512_permutexvar_epi32(firsts, dot));
    const __m128i corr = _mm_unpacklo_epi32(two_i(x->lo + g, c), two_i(x->hi + g, c));
    const __m128i dots = _mm_sub_epi32(sums, corr);
    const __m128 d = two_f(x->d + g, c);
    t = _mm_fmadd_ps(_mm_cvtepi32_ps(dots), _mm_mul_ps(sc, _mm_unpacklo_ps(d, d)), t);
    if (zp) t = _mm_fmadd_ps(z, two_f(x->sum + g, c), t);
    return t;
}

static inline __mmask16 pair_mask(int c) { return c == 2 ? (__mmask16)0xFFFF : (__mmask16)0x00FF; }

/* The 64 bytes u of chunk `chunk` (inputs 64 chunk .. 64 chunk + 63 in place's order) of one output's levels; where
 * bits is 8 and c (groups wanted) is 1, only the first 32 are read */
static inline __m512i u_vec(const uint8_t *w, int chunk, int bits, int c) {
    if (bits >= WIDENED) return _mm512_maskz_loadu_epi32(pair_mask(c), w + 64 * (size_t)chunk);
    const uint8_t *at = w + (size_t)(32 + 8 * (bits - 4)) * (size_t)chunk;
    /* the 32 nibble bytes in both halves, the upper half's shifted down a nibble (3 instructions), then each high
     * bit added where its mask says (one masked add a plane) */
    const __m512i nib = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)at));
    __m512i u = _mm512_and_si512(_mm512_mask_srli_epi16(nib, (__mmask32)0xFFFF0000u, nib, 4), _mm512_set1_epi8(0x0F));
    uint64_t high;
    memcpy(&high, at + 32, 8);
    u = _mm512_mask_add_epi8(u, (__mmask64)high, u, _mm512_set1_epi8(0x10));
    if (bits == 6) {
        memcpy(&high, at + 40, 8);
        u = _mm512_mask_add_epi8(u, (__mmask64)high, u, _mm512_set1_epi8(0x20));
    }
    return u;
}

/* acc[r] + one block of `rows` rows against one output: the block's 8 vectors loaded once for the rows */
static inline __attribute__((always_inline)) void rows_block(int rows, const uint8_t *w, scales_of s, int b,
                                                             int halves, int bits, const row_q *xr, __m512 *acc) {
    const int g = b / GROUP;
    __m512i q[8];
    for (int v = 0; v < 8; v++) q[v] = u_vec(w, b / 64 + v, bits, 2);
    const __m512 s_lo = _mm512_loadu_ps(s.s_lo + g), s_hi = _mm512_loadu_ps(s.s_hi + g);
    const __m512 z = s.z ? _mm512_loadu_ps(s.z + g) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        const int8_t *x = xr[r].xq + b;
        __m512i lo = _mm512_setzero_si512(), hi = _mm512_setzero_si512();
        for (int v = 0; v < 4; v++) {
            lo = _mm512_dpbusd_epi32(lo, q[v], _mm512_loadu_si512(x + 64 * v));
            hi = _mm512_dpbusd_epi32(hi, q[v + 4], _mm512_loadu_si512(x + 64 * (v + 4)));
        }
        acc[r] = add_block(acc[r], lo, hi, s_lo, s_hi, s.z, z, &xr[r], g, halves);
    }
}

static inline __attribute__((always_inline)) void dot_rows(int rows, const uint8_t *w, scales_of s, int k, int halves,
                                                           int bits, const row_q *xr, float *out) {
    const int blocked = k / BLOCK * BLOCK, groups = k / GROUP;
    __m512 acc[ROW_TILE];
    __m128 tail[ROW_TILE];
    for (int r = 0; r < rows; r++) {
        acc[r] = _mm512_setzero_ps();
        tail[r] = _mm_setzero_ps();
    }
    for (int b = 0; b < blocked; b += BLOCK) rows_block(rows, w, s, b, halves, bits, xr, acc);
    for (int g = blocked / GROUP; g < groups; g += 2) {
        const int c = groups - g >= 2 ? 2 : 1;
        const __m512i q = u_vec(w, GROUP * g / 64, bits, c);
        const __m128 sc = _mm_unpacklo_ps(two_f(s.s_lo + g, c), two_f(s.s_hi + g, c));
        const __m128 z = s.z ? two_f(s.z + g, c) : _mm_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512i x = _mm512_maskz_loadu_epi32(pair_mask(c), xr[r].xq + GROUP * g);
            tail[r] = add_pair(tail[r], _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, x), sc, s.z, z, &xr[r], g, c);
        }
    }
    __m512 v[8];
    for (int r = 0; r < 8; r++)
        v[r] = r < rows ? _mm512_add_ps(acc[r], _mm512_zextps128_ps512(tail[r])) : _mm512_setzero_ps();
    float sums[8];
    _mm_storeu_ps(sums, sum_four(v[0], v[1], v[2], v[3]));
    if (rows > 4) _mm_storeu_ps(sums + 4, sum_four(v[4], v[5], v[6], v[7]));
    for (int r = 0; r < rows; r++) out[r] = sums[r];
}

/* One row against four outputs at once (a decode step's case): each block's activations are loaded once for the
 * four, and their eight dot products are independent chains. w, sz: the first output's; the others follow at k bytes
 * and parts * k / 32 floats apart. Each output sums as dot_rows sums a row: the same bits. */
static inline __attribute__((always_inline)) void dot_four(const uint8_t *w, const float *sz, int k, int halves,
                                                           int offsets, int bits,
                            const row_q *x, float *out) {
    const size_t stride = row_bytes(k, bits);
    const int groups = k / GROUP, parts = 1 + halves + offsets, blocked = k / BLOCK * BLOCK;
    __m512 acc[FOUR];
    __m128 tail[FOUR];
    scales_of s[FOUR];
    for (int o = 0; o < FOUR; o++) {
        acc[o] = _mm512_setzero_ps();
        tail[o] = _mm_setzero_ps();
        s[o] = scales_at(sz + (size_t)o * parts * groups, groups, halves, offsets);
    }
    for (int b = 0; b < blocked; b += BLOCK) {
        const int g = b / GROUP;
        __m512i xv[8];
        for (int v = 0; v < 8; v++) xv[v] = _mm512_loadu_si512(x->xq + b + 64 * v);
        __m512i lo[FOUR], hi[FOUR];
        for (int o = 0; o < FOUR; o++) lo[o] = hi[o] = _mm512_setzero_si512();
        for (int v = 0; v < 4; v++)
            for (int o = 0; o < FOUR; o++) {
                const uint8_t *wo = w + (size_t)o * stride;
                lo[o] = _mm512_dpbusd_epi32(lo[o], u_vec(wo, b / 64 + v, bits, 2), xv[v]);
                hi[o] = _mm512_dpbusd_epi32(hi[o], u_vec(wo, b / 64 + v + 4, bits, 2), xv[v + 4]);
            }
        for (int o = 0; o < FOUR; o++) {
            const __m512 s_lo = _mm512_loadu_ps(s[o].s_lo + g), s_hi = _mm512_loadu_ps(s[o].s_hi + g);
            const __m512 z = s[o].z ? _mm512_loadu_ps(s[o].z + g) : _mm512_setzero_ps();
            acc[o] = add_block(acc[o], lo[o], hi[o], s_lo, s_hi, s[o].z, z, x, g, halves);
        }
    }
    for (int g = blocked / GROUP; g < groups; g += 2) {
        const int c = groups - g >= 2 ? 2 : 1;
        const __m512i xv = _mm512_maskz_loadu_epi32(pair_mask(c), x->xq + GROUP * g);
        for (int o = 0; o < FOUR; o++) {
            const __m512i q = u_vec(w + (size_t)o * stride, GROUP * g / 64, bits, c);
            const __m128 sc = _mm_unpacklo_ps(two_f(s[o].s_lo + g, c), two_f(s[o].s_hi + g, c));
            const __m128 z = s[o].z ? two_f(s[o].z + g, c) : _mm_setzero_ps();
            tail[o] = add_pair(tail[o], _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xv), sc, s[o].z, z, x, g, c);
        }
    }
    for (int o = 0; o < FOUR; o++) acc[o] = _mm512_add_ps(acc[o], _mm512_zextps128_ps512(tail[o]));
    _mm_storeu_ps(out, sum_four(acc[0], acc[1], acc[2], acc[3]));
}
#elif defined(PATH_256)
/* u . x of 32 weight bytes (u = q + zero) and 32 activations, 8 lanes: VNNI's, then less zero x sum(x) (corr, per
 * lane); without VNNI, 8-bit levels multiply |q| by x with q's sign, which needs no correction, and the narrower ones
 * (u below 64: 2 x 63 x 127 fits 16 bits) u by x as they are */
#define NEEDS_CORR(bits) (VNNI_256 || (bits) != 8)
#if defined(__AVXVNNI__)
#define VNNI_256 1
#else
#define VNNI_256 0
#endif
static inline __m256i dot_bytes(__m256i u, __m256i x, __m256i corr, int bits) {
#if defined(__AVXVNNI__)
    (void)bits;
    return _mm256_sub_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, x), corr);
#else
    if (bits != 8)
        return _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)), corr);
    const __m256i q = _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80));
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(x, q)), _mm256_set1_epi16(1));
#endif
}

/* The 32 bytes u of inputs p .. p + 31 (p a multiple of 32, place's order) of one output's levels */
static inline __m256i u_32(const uint8_t *w, int p, int bits) {
    if (bits >= WIDENED) return _mm256_loadu_si256((const __m256i *)(w + p));
    const uint8_t *at = w + (size_t)(32 + 8 * (bits - 4)) * (size_t)(p / 64);
    const int part = p / 32 % 2;
    const __m256i nib = _mm256_loadu_si256((const __m256i *)at), low = _mm256_set1_epi8(0x0F);
    __m256i u = _mm256_and_si256(part ? _mm256_srli_epi16(nib, 4) : nib, low);
    /* byte i of each high-bit plane's 32 bits, spread to bytes 8 (i % 4) .. 8 (i % 4) + 7 of a lane, one bit each */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                            3, 3, 3, 3, 3, 3, 3);
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    for (int plane = 0; plane < bits - 4; plane++) {
        uint32_t high;
        memcpy(&high, at + 32 + 8 * plane + 4 * part, 4);
        const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)high), spread);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, select), select);
        u = _mm256_or_si256(u, _mm256_and_si256(set, _mm256_set1_epi8((char)(0x10 << plane))));
    }
    return u;
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Half a block at a time (its groups 0..7, then 8..15), as the AVX512 path sums whole blocks; a tail group's halves
 * summed apart */
static inline __attribute__((always_inline)) void dot_rows(int rows, const uint8_t *w, scales_of s, int k, int halves,
                                                           int bits, const row_q *xr, float *out) {
    const int blocked = k / BLOCK * BLOCK, groups = k / GROUP;
    __m256 acc[ROW_TILE];
    float tail[ROW_TILE];
    for (int r = 0; r < rows; r++) {
        acc[r] = _mm256_setzero_ps();
        tail[r] = 0.0f;
    }
    for (int b = 0; b < blocked; b += BLOCK)
        for (int part = 0; part < 2; part++) {
            const int g = b / GROUP + 8 * part, at = 32 * part;
            __m256i q[8];
            for (int v = 0; v < 8; v++) q[v] = u_32(w, b + 64 * v + at, bits);
            const __m256 s_lo = _mm256_loadu_ps(s.s_lo + g), s_hi = _mm256_loadu_ps(s.s_hi + g);
            const __m256 z = s.z ? _mm256_loadu_ps(s.z + g) : _mm256_setzero_ps();
            for (int r = 0; r < rows; r++) {
                const int8_t *x = xr[r].xq + b + at;
                const __m256i c_lo = _mm256_loadu_si256((const __m256i *)(xr[r].lo + g));
                const __m256i c_hi = _mm256_loadu_si256((const __m256i *)(xr[r].hi + g));
                __m256i lo = dot_bytes(q[0], _mm256_loadu_si256((const __m256i *)x), c_lo, bits);
                __m256i hi = dot_bytes(q[4], _mm256_loadu_si256((const __m256i *)(x + 256)), c_hi, bits);
                for (int v = 1; v < 4; v++) {
                    const __m256i none = _mm256_setzero_si256();
                    lo = _mm256_add_epi32(
                        lo, dot_bytes(q[v], _mm256_loadu_si256((const __m256i *)(x + 64 * v)), none, bits));
                    hi = _mm256_add_epi32(
                        hi, dot_bytes(q[v + 4], _mm256_loadu_si256((const __m256i *)(x + 64 * (v + 4))), none, bits));
                }
                const __m256 d = _mm256_loadu_ps(xr[r].d + g);
                if (halves) {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_mul_ps(s_lo, d), acc[r]);
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_mul_ps(s_hi, d), acc[r]);
                } else {
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), _mm256_mul_ps(s_lo, d),
                                             acc[r]);
                }
                if (s.z) acc[r] = _mm256_fmadd_ps(z, _mm256_loadu_ps(xr[r].sum + g), acc[r]);
            }
        }
    for (int g = blocked / GROUP; g < groups; g++) {
        const __m256i q = u_32(w, GROUP * g, bits);
        for (int r = 0; r < rows; r++) {
            const __m256i x = _mm256_loadu_si256((const __m256i *)(xr[r].xq + GROUP * g));
            __m256i dot = dot_bytes(q, x, _mm256_setzero_si256(), bits);
            dot = _mm256_add_epi32(dot, _mm256_shuffle_epi32(dot, _MM_SHUFFLE(1, 0, 3, 2)));
            dot = _mm256_add_epi32(dot, _mm256_shuffle_epi32(dot, _MM_SHUFFLE(2, 3, 0, 1)));
            int32_t lo = _mm256_cvtsi256_si32(dot), hi = _mm256_extract_epi32(dot, 4);
            if (NEEDS_CORR(bits)) {
                lo -= xr[r].lo[g];
                hi -= xr[r].hi[g];
            }
            /* fused steps written out: left to the compiler, each specialization of dot_rows may fuse its own way */
            const float d = xr[r].d[g];
            float t = fmaf((float)lo, s.s_lo[g] * d, tail[r]);
            t = fmaf((float)hi, s.s_hi[g] * d, t);
            tail[r] = s.z ? fmaf(s.z[g], xr[r].sum[g], t) : t;
        }
    }
    for (int r = 0; r < rows; r++) out[r] = hsum256(acc[r]) + tail[r];
}
#else
static inline void dot_rows(int rows, const uint8_t *w, scales_of s, int k, int halves, int bits, const row_q *xr,
                            float *out) {
    for (int r = 0; r < rows; r++) {
        float acc = 0.0f;
        for (int g = 0; g < k / GROUP; g++) {
            int32_t lo = 0, hi = 0;
            for (int i = GROUP * g; i < GROUP * (g + 1); i++) {
                const int product = u_at(w, place(i, k), bits) * xr[r].xq[place(i, k)];
                if (i < GROUP * g + GROUP / 2) lo += product; else hi += product;
            }
            lo -= xr[r].lo[g];
            hi -= xr[r].hi[g];
            const float d = xr[r].d[g];
            if (halves) acc += (float)lo * (s.s_lo[g] * d) + (float)hi * (s.s_hi[g] * d);
            else acc += (float)(lo + hi) * (s.s_lo[g] * d);
            if (s.z) acc += s.z[g] * xr[r].sum[g];
        }
        out[r] = acc;
    }
}
#endif

static inline void prefetch_outputs(const uint8_t *w, const void *sz, size_t scale_bytes, size_t stride, int j) {
    /* addresses made as integers: past the last output a prefetch may point beyond the matrix, and never faults */
    const uintptr_t wj = (uintptr_t)w + (uintptr_t)j * stride, szj = (uintptr_t)sz + (uintptr_t)j * scale_bytes;
    for (size_t b = 0; b < stride; b += 64) __builtin_prefetch((const void *)(wj + b));
    for (size_t b = 0; b < scale_bytes; b += 64) __builtin_prefetch((const void *)(szj + b));
}

/* u of one output's k levels at `bits` bits, a byte each, into u (k + 64 bytes: a last half chunk spills) */
static void widen_output(const uint8_t *w, int k, int bits, uint8_t *u) {
#if defined(PATH_512)
    for (int c = 0; c < (k + 63) / 64; c++) _mm512_storeu_si512(u + 64 * c, u_vec(w, c, bits, 2));
#elif defined(PATH_256)
    for (int p = 0; p < k; p += 32) _mm256_storeu_si256((__m256i *)(u + p), u_32(w, p, bits));
#else
    for (int p = 0; p < k; p++) u[p] = (uint8_t)u_at(w, p, bits);
#endif
}

/* How an output's scales are held (its per_output = parts x k/32 of them): */
#define SCALES_FLOAT 0 /* float32 */
#define SCALES_HALF 1  /* IEEE halves: the file's fp16 d and m (Q8_0, Q5_0, Q5_1) */
#define SCALES_K 2     /* per_output int8 sub-scales, then per 8 of them an IEEE half: the K types' d sc, dmin m */

static inline size_t scale_bytes_of(int format, size_t per_output) {
    return format == SCALES_FLOAT ? 4 * per_output : format == SCALES_HALF ? 2 * per_output : per_output / 4 * 5;
}

/* The scales of outputs j .. j + count - 1 as floats: where they are, or converted into held. A K type's scale is the
 * product of a half (11-bit mantissa) and an integer of 8 bits at most: exact in float32, the same bits as gguf-py's
 * float32 product. */
static inline const float *scales_from(const void *sz, int format, int j, int count, size_t per_output, float *held) {
    if (format == SCALES_FLOAT) return (const float *)sz + (size_t)j * per_output;
    if (format == SCALES_HALF) {
        halves_to_floats((const uint16_t *)sz + (size_t)j * per_output, held, (size_t)count * per_output);
        return held;
    }
    const size_t bytes = scale_bytes_of(format, per_output);
    for (int o = 0; o < count; o++) {
        const uint8_t *at = (const uint8_t *)sz + (size_t)(j + o) * bytes;
        const int8_t *ints = (const int8_t *)at;
        float *f = held + (size_t)o * per_output;
        size_t i = 0;
#if defined(PATH_512)
        /* 16 sub-scales at once: their two multipliers picked from 16 converted together */
        const __m512i pair = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
        __m512 multipliers = _mm512_setzero_ps();
        for (; i + 16 <= per_output; i += 16) {
            if (i % 128 == 0) {
                const size_t left = (per_output - i) / 8;
                const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
                multipliers = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, at + per_output + 2 * (i / 8)));
            }
            const __m512 d =
                _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_set1_epi32((int)(i % 128 / 8)), pair), multipliers);
            const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(ints + i))));
            _mm512_storeu_ps(f + i, _mm512_mul_ps(d, v));
        }
#endif
        for (; i < per_output; i += 8) {
            uint16_t h;
            memcpy(&h, at + per_output + 2 * (i / 8), 2);
            const float d = half_to_float(h);
            for (size_t e = i; e < i + 8; e++) f[e] = d * (float)ints[e];
        }
    }
    return held;
}

/* y (rows x n) = x (rows x k) W^T + bias (NULL: none). w: n outputs of row_bytes(k, bits) bytes, a level q held as
 * u = q + zero in `bits` bits (8, 6 or 5); sz: n x parts x k/32 scales, parts = 1 + halves + offsets, as floats or as
 * scale_format says (converted to floats a block of outputs at a time; SCALES_K needs k a multiple of 256). threads:
 * how many OpenMP threads share the outputs (the stage's torch threads).
 * Returns 0; -1 where scratch memory could not be had, -2 where k is not a multiple of 32, -3 where bits, zero or
 * scale_format is not one of these (y untouched but on -1). */
/* dot_rows with a constant row count and level width, so that each case's loops unroll and the width's branches go:
 * a width known only at run time cost the 8-bit path 15 % (1536 x 576, 1 row) */
#define DOT_ROWS_TILE(b)                                                 \
    switch (tile) {                                                      \
        case 8: dot_rows(8, wj, s, k, halves, b, xr, out); break;        \
        case 7: dot_rows(7, wj, s, k, halves, b, xr, out); break;        \
        case 6: dot_rows(6, wj, s, k, halves, b, xr, out); break;        \
        case 5: dot_rows(5, wj, s, k, halves, b, xr, out); break;        \
        case 4: dot_rows(4, wj, s, k, halves, b, xr, out); break;        \
        case 3: dot_rows(3, wj, s, k, halves, b, xr, out); break;        \
        case 2: dot_rows(2, wj, s, k, halves, b, xr, out); break;        \
        default: dot_rows(1, wj, s, k, halves, b, xr, out); break;       \
    }
static void dot_rows_any(int tile, const uint8_t *wj, scales_of s, int k, int halves, int bits, const row_q *xr,
                         float *out) {
    switch (bits) {
        case 8: DOT_ROWS_TILE(8); break;
        case WIDENED: DOT_ROWS_TILE(WIDENED); break;
        case 6: DOT_ROWS_TILE(6); break;
        default: DOT_ROWS_TILE(5); break;
    }
}

/* Output j's scales as floats: where they are, or in held, its block's (from output `first`) converted */
static inline const float *scales_of_output(const void *sz, int format, int j, int first, size_t per_output,
                                            const float *held) {
    if (format == SCALES_FLOAT) return (const float *)sz + (size_t)j * per_output;
    return held + (size_t)(j - first) * per_output;
}

int swarm_q8_mm(const float *x, int rows, int k, int n, const uint8_t *w, const void *sz, int halves, int offsets,
                int bits, int zero, int scale_format, const float *bias, float *y, int threads) {
    if (threads < 1) threads = 1;
    if (k % GROUP || k <= 0) return -2;
    if ((bits != 8 && bits != 6 && bits != 5) || zero < 0 || zero >= (1 << bits)) return -3;
    if (scale_format < SCALES_FLOAT || scale_format > SCALES_K || (scale_format == SCALES_K && k % 256)) return -3;
    const size_t stride = row_bytes(k, bits);
    halves = halves ? 1 : 0;
    offsets = offsets ? 1 : 0;
    const int groups = k / GROUP, parts = 1 + halves + offsets;
    const size_t per_output = (size_t)parts * groups, scale_bytes = scale_bytes_of(scale_format, per_output);
    /* the activations' scratch: kept per calling thread, grown as needed */
    static __thread void *scratch = NULL;
    static __thread size_t held = 0;
    const size_t per_row = (size_t)k + 4 * sizeof(float) * (size_t)groups;
    const size_t need = per_row * (size_t)rows + 64;
    if (need > held) {
        void *grown = realloc(scratch, need);
        if (!grown) return -1;
        scratch = grown;
        held = need;
    }
    float *d = scratch, *sum = d + (size_t)rows * groups;
    int32_t *lo = (int32_t *)(sum + (size_t)rows * groups), *hi = lo + (size_t)rows * groups;
    int8_t *xq = (int8_t *)(hi + (size_t)rows * groups);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 8)
    for (int r = 0; r < rows; r++) {
        const size_t at = (size_t)r * groups;
        const row_q q = {xq + (size_t)r * k, d + at, sum + at, lo + at, hi + at};
        quantize_row(x + (size_t)r * k, k, zero, q);
    }

    const int blocks = (n + OUT_BLOCK - 1) / OUT_BLOCK;
    int short_of_memory = 0;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int block = 0; block < blocks; block++) {
        const int first = block * OUT_BLOCK, last = first + OUT_BLOCK < n ? first + OUT_BLOCK : n;
        /* the block's scales as floats, converted once for all its row tiles where they are held otherwise */
        static __thread float *held = NULL;
        static __thread size_t held_floats = 0;
        if (scale_format != SCALES_FLOAT) {
            if ((size_t)OUT_BLOCK * per_output > held_floats) {
                float *grown = realloc(held, (size_t)OUT_BLOCK * per_output * sizeof(float));
                if (!grown) {
#pragma omp atomic write
                    short_of_memory = 1;
                    continue;
                }
                held = grown;
                held_floats = (size_t)OUT_BLOCK * per_output;
            }
            scales_from(sz, scale_format, first, last - first, per_output, held);
        }
        /* more than one row tile (a prefill): the block's 5- or 6-bit levels unpacked once, not once a tile -- 5 to
         * 13 % of a 64-row product on Gemma 3's shapes (bench/RESULTS.md) */
        static __thread uint8_t *wide = NULL;
        static __thread size_t wide_held = 0;
        const size_t wide_need = (size_t)OUT_BLOCK * k + 64;
        int widened = bits < WIDENED && rows > ROW_TILE;
        if (widened && wide_need > wide_held) {
            uint8_t *grown = realloc(wide, wide_need);
            if (grown) {
                wide = grown;
                wide_held = wide_need;
            } else {
                widened = 0; /* no memory for it: each tile unpacks for itself */
            }
        }
        if (widened)
            for (int j = first; j < last; j++)
                widen_output(w + (size_t)j * stride, k, bits, wide + (size_t)(j - first) * k);
        const int tile_bits = widened ? WIDENED : bits;
        for (int r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int tile = rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE;
            row_q xr[ROW_TILE];
            for (int r = 0; r < tile; r++) {
                const size_t at = (size_t)(r0 + r) * groups;
                const row_q q = {xq + (size_t)(r0 + r) * k, d + at, sum + at, lo + at, hi + at};
                xr[r] = q;
            }
            float out[ROW_TILE];
            int j = first;
#if defined(PATH_512)
            if (tile == 1)
                for (; j + FOUR <= last; j += FOUR) {
                    prefetch_outputs(w, sz, scale_bytes, stride, j + PREFETCH);
                    prefetch_outputs(w, sz, scale_bytes, stride, j + PREFETCH + 1);
                    prefetch_outputs(w, sz, scale_bytes, stride, j + PREFETCH + 2);
                    prefetch_outputs(w, sz, scale_bytes, stride, j + PREFETCH + 3);
                    const float *sj = scales_of_output(sz, scale_format, j, first, per_output, held);
                    const uint8_t *wj = w + (size_t)j * stride;
                    switch (bits) { /* a constant width, as dot_rows_any */
                        case 8: dot_four(wj, sj, k, halves, offsets, 8, xr, out); break;
                        case 6: dot_four(wj, sj, k, halves, offsets, 6, xr, out); break;
                        default: dot_four(wj, sj, k, halves, offsets, 5, xr, out); break;
                    }
                    for (int o = 0; o < FOUR; o++) y[(size_t)r0 * n + j + o] = out[o] + (bias ? bias[j + o] : 0.0f);
                }
#endif
            for (; j < last; j++) {
                if (r0 == 0) prefetch_outputs(w, sz, scale_bytes, stride, j + PREFETCH);
                const uint8_t *wj = widened ? wide + (size_t)(j - first) * k : w + (size_t)j * stride;
                const scales_of s = scales_at(scales_of_output(sz, scale_format, j, first, per_output, held), groups,
                                              halves, offsets);
                dot_rows_any(tile, wj, s, k, halves, tile_bits, xr, out);
                const float b = bias ? bias[j] : 0.0f;
                for (int r = 0; r < tile; r++) y[(size_t)(r0 + r) * n + j] = out[r] + b;
            }
        }
    }
    return short_of_memory ? -1 : 0;
}
