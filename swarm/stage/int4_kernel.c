/* swarm's int4 matrix kernel for CPUs: y = x W^T (+ b), with W in 4 bits and x quantized to 8 bits as it comes in,
 * the scheme of llama.cpp's Q4 x Q8 dot products (swarm/stage/int4_kernel.py builds and loads this file).
 *
 * W (n outputs x k inputs): groups of 32 inputs, each with a bfloat16 scale s and offset z (w = (q - 8) s + z, q in
 * 0..15 -- the grid of swarm.stage.quantize's Int4Linear), or, through swarm_int4_mm_exact, a float32 or float16
 * scale s and the offset's factor m = z - 8 s itself (w = q s + m): the forms that hold a GGUF's Q4_0, Q4_1 and Q4_K
 * blocks exactly (d and -8 d, d and m in float16; d sc and -dmin m in float32; swarm/stage/gguf_linear.py). An output's inputs come in blocks of 16 groups (512
 * inputs), then a tail of pairs of groups where k is not a multiple of 512:
 *  - a block is 8 vectors of 64 weights, vector v holding inputs 4v..4v+3 of each of its 16 groups (group g in bytes
 *    4g..4g+3, one 32-bit lane). The VNNI dot product of a vector with the activations in the same order sums four
 *    products per lane, so 8 of them sum each group's 32 products in its own lane, in integers, and a block needs one
 *    conversion to float and one multiply-add by its 16 groups' s d per row. Stored in 256 bytes: 64 bytes hold vector
 *    c (0..3) in their low nibbles and vector c + 4 in their high ones, so one load and a mask or a shift unpack 64
 *    weights;
 *  - a tail pair (64 inputs) is 32 bytes, byte j holding the first group's weight j in its low nibble and the second
 *    group's weight j in its high one; it is unpacked into the order lane_of gives (four of the first group, four of
 *    the second, ...), and each pair takes its own conversion and multiply-add.
 * The tail follows the blocks; on odd outputs it comes first where it has an odd number of pairs, so that from 64-byte
 * aligned memory the blocks never straddle a cache line. An output takes k / 2 bytes; its scales are stored before
 * its offsets.
 *
 * x (rows x k, float32): each row's groups of 32 quantized alone, d = max|x| / 127, xq = round(x / d), so a row's
 * result never depends on the other rows of the call (a batch computes each chat's row as it would alone); xq is laid
 * out as the weights unpack (place gives where each input goes).
 *
 *   y = sum over groups of  s d (q . xq)  +  (z - 8 s) sum(x)
 *
 * q . xq is an unsigned-by-signed byte dot product: VNNI instructions where the CPU has AVX512-VNNI, AVX2's
 * multiply-adds elsewhere on x86-64, plain C on other processors. Each output is summed by one thread in a fixed order:
 * the same inputs give the same bits, whatever the thread count and whichever rows share the call. Outputs are split
 * over OpenMP threads (torch's own runtime: libgomp is loaded once per process).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#if defined(__x86_64__) && (defined(__AVX2__) || defined(__AVX512F__))
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define PATH_512 1
#define PATH_NAME "avx512-vnni"
#elif defined(__AVX2__) && defined(__FMA__)
#define PATH_256 1
#if defined(__AVXVNNI__)
#define PATH_NAME "avx2-vnni"
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define PATH_NAME "avx2-vnni512"
#else
#define PATH_NAME "avx2"
#endif
#else
#define PATH_NAME "generic"
#endif

#define OUT_BLOCK 16 /* outputs a thread takes at a time */
#define ROW_TILE 8   /* rows that share one unpacking of the weights: drafting's verifying pass of 4 guesses in one */
_Static_assert(ROW_TILE <= 8, "a tile's rows are summed four at a time (sum_four, twice) and dispatched by a switch "
                              "of 1-8");
#define BLOCK 512       /* inputs of a block: 16 groups of 32 */
#define MAX_TAIL 14     /* groups a tail can have: 7 pairs */

const char *swarm_int4_path(void) { return PATH_NAME; }

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

/* IEEE half precision to float (exact: every half is a float) */
static inline float f16_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    union { uint32_t u; float f; } v;
    if (exponent == 0x1F) v.u = sign | 0x7F800000 | (mantissa << 13); /* inf, nan */
    else if (exponent) v.u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    else { /* zero and subnormals: mantissa * 2^-24 */
        v.f = (float)mantissa * 5.9604644775390625e-08f;
        v.u |= sign;
    }
    return v.f;
}

/* How a matrix's scales are held (fmt): per output, its k / 32 scales then its k / 32 offsets -- */
#define SCALES_BF16 0 /* bfloat16 s and z, m = z - 8 s (int4-fast's) */
#define SCALES_F32 1  /* float32 s and m (a GGUF's Q4_K: d sc and -dmin m) */
#define SCALES_F16 2  /* float16 s and m (a GGUF's Q4_0 and Q4_1: d and -8 d, d and m) */
/* output j's scales start k / 16 values after output j - 1's */
static inline const void *scales_of(const void *sz, int fmt, size_t j, int k) {
    return (const char *)sz + j * (size_t)(k / 16) * (fmt == SCALES_F32 ? 4 : 2);
}
static inline float half_at(const void *sz, int fmt, int i) {
    if (fmt == SCALES_F32) return ((const float *)sz)[i];
    const uint16_t h = ((const uint16_t *)sz)[i];
    return fmt == SCALES_F16 ? f16_to_float(h) : bf16_to_float(h);
}
static inline float scale_at(const void *sz, int fmt, int g) { return half_at(sz, fmt, g); }
/* m = z - 8 s of group g (groups: the output's k / 32) */
static inline float factor_at(const void *sz, int fmt, int groups, int g) {
    if (fmt != SCALES_BF16) return half_at(sz, fmt, groups + g);
    return half_at(sz, fmt, groups + g) - 8.0f * half_at(sz, fmt, g);
}

/* The byte of a tail pair's 64 quantized activations that meets weight j (0..31) of its first group (second: + 4): the
 * packed bytes widen four at a time into alternate 32-bit lanes, the first group's low nibbles then the second's high
 * ones, so the activations are laid out four of the first group, four of the second, and so on. */
static inline int lane_of(int j) { return 8 * (j / 4) + j % 4; }

/* Where input i of a row goes in its quantized activations: in a block, vector (i % 32) / 4, the lane of its group; in
 * the tail, its pair's lane_of order */
static inline int place(int i, int k) {
    const int blocked = k / BLOCK * BLOCK;
    if (i < blocked) {
        const int r = i % BLOCK;
        return i - r + 64 * (r % 32 / 4) + 4 * (r / 32) + r % 4;
    }
    const int r = (i - blocked) % 64;
    return i - r + lane_of(r % 32) + 4 * (r / 32);
}

/* Output j's weights (its k / 2 bytes at wj): its blocks, and its tail's pairs (first on odd outputs where the tail has
 * an odd number of pairs) */
static inline int tail_pairs(int k) { return k % BLOCK / 64; }
static inline const uint8_t *blocks_at(const uint8_t *wj, int j, int k) {
    return wj + ((tail_pairs(k) & j & 1) ? 32 * tail_pairs(k) : 0);
}
static inline const uint8_t *tail_at(const uint8_t *wj, int j, int k) {
    return wj + ((tail_pairs(k) & j & 1) ? 0 : k / BLOCK * (BLOCK / 2));
}

/* One row: xq (k bytes, in place's order), d and sum(x) per group of 32 (k / 32 floats each). */
#if defined(PATH_512)
static inline void quantize_group(const float *v, __m512i *q, float *d, float *sum) {
    const __m512 a = _mm512_loadu_ps(v), b = _mm512_loadu_ps(v + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    *sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    *d = amax / 127.0f;
    const __m512 inv = _mm512_set1_ps(*d > 0.0f ? 1.0f / *d : 0.0f);
    /* rounded to the nearest (even) integer, as rintf; |x / d| <= 127 */
    const __m128i lo = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)));
    const __m128i hi = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv)));
    *q = _mm512_castsi256_si512(_mm256_set_m128i(hi, lo));
}

static void quantize_row(const float *x, int k, int8_t *xq, float *dx, float *sx) {
    const int blocked = k / BLOCK * BLOCK;
    const __m512i groups = _mm512_set_epi32(120, 112, 104, 96, 88, 80, 72, 64, 56, 48, 40, 32, 24, 16, 8, 0);
    for (int b = 0; b < blocked; b += BLOCK) {
        int8_t natural[BLOCK] __attribute__((aligned(64)));
        for (int g = 0; g < 16; g++) {
            __m512i q;
            quantize_group(x + b + 32 * g, &q, dx + b / 32 + g, sx + b / 32 + g);
            _mm256_store_si256((__m256i *)(natural + 32 * g), _mm512_castsi512_si256(q));
        }
        for (int v = 0; v < 8; v++) /* vector v: four bytes (dword v) of each group */
            _mm512_storeu_si512((void *)(xq + b + 64 * v),
                                _mm512_i32gather_epi32(_mm512_add_epi32(groups, _mm512_set1_epi32(v)), natural, 4));
    }
    /* a tail pair: four bytes of the first group, four of the second, ...: dwords 0..7 of each group interleaved */
    const __m512i order = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int i = blocked; i < k; i += 64) {
        __m512i a, b;
        quantize_group(x + i, &a, dx + i / 32, sx + i / 32);
        quantize_group(x + i + 32, &b, dx + i / 32 + 1, sx + i / 32 + 1);
        _mm512_storeu_si512((void *)(xq + i), _mm512_permutex2var_epi32(a, order, b));
    }
}
#else
static void quantize_row(const float *x, int k, int8_t *xq, float *dx, float *sx) {
    for (int g = 0; g < k / 32; g++) {
        const float *v = x + 32 * g;
        float amax = 0.0f, sum = 0.0f;
        for (int i = 0; i < 32; i++) {
            float a = fabsf(v[i]);
            amax = a > amax ? a : amax;
            sum += v[i];
        }
        float d = amax / 127.0f;
        float inv = d > 0.0f ? 1.0f / d : 0.0f;
        for (int i = 0; i < 32; i++) {
            float r = rintf(v[i] * inv);
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            xq[place(32 * g + i, k)] = (int8_t)r;
        }
        dx[g] = d;
        sx[g] = sum;
    }
}
#endif

/* w: one output's k / 2 packed bytes; sz, fmt: its scales (scales_of); xq, dx, sx: `rows`
 * rows of quantized activations (k, k / 32 and k / 32 apart); out: a result per row. */
#if defined(PATH_512)
static inline __m512 two_floats(const float *ab) {
    double both;
    memcpy(&both, ab, 8);
    return _mm512_castpd_ps(_mm512_set1_pd(both));
}

/* groups g.. (those in `some`) of one output: their scales s as floats into *scales, and z - 8 s returned */
static inline __m512 widen_scales(const void *scales_, int fmt, int groups, int g, __mmask16 some, __m512 *scales) {
    if (fmt == SCALES_F32) {
        *scales = _mm512_maskz_loadu_ps(some, (const float *)scales_ + g);
        return _mm512_maskz_loadu_ps(some, (const float *)scales_ + groups + g);
    }
    if (fmt == SCALES_F16) {
        *scales = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(some, (const uint16_t *)scales_ + g));
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(some, (const uint16_t *)scales_ + groups + g));
    }
    const uint16_t *sz = scales_;
    *scales = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(some, sz + g)), 16));
    const __m512 z = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(some, sz + groups + g)), 16));
    return _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), *scales, z);
}

/* a block's 8 vectors of weights from its 256 bytes */
static inline void unpack_block(const uint8_t *block, __m512i *q) {
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_loadu_si512((const void *)(block + 64 * c));
        q[c] = _mm512_and_si512(v, nibble);
        q[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    }
}

/* acc + s d (q . x) + (z - 8 s) sum(x) over a block's 16 groups: dot its integer dot products, s and m its scales and
 * their offsets' factors, d and sum the row's */
static inline __m512 add_block(__m512 acc, __m512i dot, __m512 s, __m512 m, const float *d, const float *sum) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_loadu_ps(d)), acc);
    return _mm512_fmadd_ps(m, _mm512_loadu_ps(sum), acc);
}

/* a tail pair's 64 weights from its 32 bytes, widened into the activations' order */
static inline __m512i unpack_pair(const uint8_t *w) {
    const __m512i v = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)w));
    return _mm512_and_si512(_mm512_or_si512(v, _mm512_slli_epi64(v, 28)), _mm512_set1_epi8(0x0F));
}

/* The tail's part of one row against one output: its offsets' terms added to acc, and its pairs' s d (q . x) summed
 * apart (returned). q: the tail's unpacked pairs; s, m: its groups' scales and offsets' factors (lanes 0..); x, d, sum:
 * the row's tail. */
static inline __m512 tail_sum(int pairs, const __m512i *q, __m512 s, __m512 m, const int8_t *x, const float *d,
                              const float *sum, __mmask16 some, __m512 *acc) {
    *acc = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(some, sum), *acc);
    float sd[16];
    _mm512_storeu_ps(sd, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(some, d)));
    __m512 t = _mm512_setzero_ps();
    for (int p = 0; p < pairs; p++) {
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[p], _mm512_loadu_si512((const void *)(x + 64 * p)));
        t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), two_floats(sd + 2 * p), t);
    }
    return t;
}

/* The sums of four vectors' lanes, at once: halves added, then pairwise sums across the four */
static inline __m128 sum_four(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m256 a8 = _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
    const __m256 b8 = _mm256_add_ps(_mm512_castps512_ps256(b), _mm512_extractf32x8_ps(b, 1));
    const __m256 c8 = _mm256_add_ps(_mm512_castps512_ps256(c), _mm512_extractf32x8_ps(c, 1));
    const __m256 d8 = _mm256_add_ps(_mm512_castps512_ps256(d), _mm512_extractf32x8_ps(d, 1));
    const __m256 all = _mm256_hadd_ps(_mm256_hadd_ps(a8, b8), _mm256_hadd_ps(c8, d8));
    return _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
}

/* One row against four outputs at once (a decode step's case): each block's activations are loaded once for the
 * four. w, sz: output j's; the others follow at k / 2 bytes and k / 16 scales apart (scales_of). Each output sums as dot_rows
 * sums a row: the same bits. */
#define FOUR 4
static inline void dot_four(int j, const uint8_t *w, const void *sz, int fmt, int k, const int8_t *xq, const float *dx,
                            const float *sx, float *out) {
    const int groups = k / 32, blocked = k / BLOCK * BLOCK, pairs = tail_pairs(k);
    __m512 acc[FOUR], tail[FOUR];
    for (int o = 0; o < FOUR; o++) acc[o] = _mm512_setzero_ps();
    for (int b = 0; b < blocked; b += BLOCK) {
        /* the four outputs' dot products side by side, 64 bytes of each at a time: eight independent chains */
        const __m512i nibble = _mm512_set1_epi8(0x0F);
        __m512i lo[FOUR], hi[FOUR];
        for (int o = 0; o < FOUR; o++) lo[o] = hi[o] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            const __m512i x0 = _mm512_loadu_si512((const void *)(xq + b + 64 * c));
            const __m512i x1 = _mm512_loadu_si512((const void *)(xq + b + 64 * c + 256));
            for (int o = 0; o < FOUR; o++) {
                const __m512i v = _mm512_loadu_si512(
                    (const void *)(blocks_at(w + (size_t)o * (k / 2), j + o, k) + b / 2 + 64 * c));
                lo[o] = _mm512_dpbusd_epi32(lo[o], _mm512_and_si512(v, nibble), x0);
                hi[o] = _mm512_dpbusd_epi32(hi[o], _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), x1);
            }
        }
        for (int o = 0; o < FOUR; o++) {
            __m512 s;
            const __m512 m = widen_scales(scales_of(sz, fmt, o, k), fmt, groups, b / 32, (__mmask16)0xFFFF, &s);
            acc[o] = add_block(acc[o], _mm512_add_epi32(lo[o], hi[o]), s, m, dx + b / 32, sx + b / 32);
        }
    }
    for (int o = 0; o < FOUR; o++) {
        tail[o] = _mm512_setzero_ps();
        if (pairs) {
            const uint8_t *t = tail_at(w + (size_t)o * (k / 2), j + o, k);
            __m512i q[MAX_TAIL / 2];
            for (int p = 0; p < pairs; p++) q[p] = unpack_pair(t + 32 * p);
            const __mmask16 some = (__mmask16)((1u << (2 * pairs)) - 1);
            __m512 s;
            const __m512 m = widen_scales(scales_of(sz, fmt, o, k), fmt, groups, blocked / 32, some, &s);
            tail[o] = tail_sum(pairs, q, s, m, xq + blocked, dx + blocked / 32, sx + blocked / 32, some, &acc[o]);
        }
    }
    _mm_storeu_ps(out, sum_four(_mm512_add_ps(acc[0], tail[0]), _mm512_add_ps(acc[1], tail[1]),
                                _mm512_add_ps(acc[2], tail[2]), _mm512_add_ps(acc[3], tail[3])));
}

static inline __attribute__((always_inline)) void dot_rows(int rows, int j, const uint8_t *w, const void *sz,
                                                           int fmt, int k, const int8_t *xq, const float *dx, const float *sx,
                                                           float *out) {
    const int groups = k / 32, blocked = k / BLOCK * BLOCK, pairs = tail_pairs(k);
    __m512 acc[ROW_TILE], tail[ROW_TILE];
    for (int r = 0; r < rows; r++) acc[r] = tail[r] = _mm512_setzero_ps();
    const uint8_t *blocks = blocks_at(w, j, k);
    for (int b = 0; b < blocked; b += BLOCK) {
        __m512i q[8];
        unpack_block(blocks + b / 2, q);
        __m512 s;
        const __m512 m = widen_scales(sz, fmt, groups, b / 32, (__mmask16)0xFFFF, &s);
        __m512i dot[ROW_TILE];
        for (int r = 0; r < rows; r++) dot[r] = _mm512_setzero_si512();
        for (int v = 0; v < 8; v++) /* the rows side by side: independent chains */
            for (int r = 0; r < rows; r++)
                dot[r] = _mm512_dpbusd_epi32(dot[r], q[v], _mm512_loadu_si512((const void *)(xq + (size_t)r * k + b + 64 * v)));
        for (int r = 0; r < rows; r++)
            acc[r] = add_block(acc[r], dot[r], s, m, dx + (size_t)r * groups + b / 32, sx + (size_t)r * groups + b / 32);
    }
    if (pairs) {
        const uint8_t *t = tail_at(w, j, k);
        __m512i q[MAX_TAIL / 2];
        for (int p = 0; p < pairs; p++) q[p] = unpack_pair(t + 32 * p);
        const __mmask16 some = (__mmask16)((1u << (2 * pairs)) - 1);
        __m512 s;
        const __m512 m = widen_scales(sz, fmt, groups, blocked / 32, some, &s);
        for (int r = 0; r < rows; r++)
            tail[r] = tail_sum(pairs, q, s, m, xq + (size_t)r * k + blocked, dx + (size_t)r * groups + blocked / 32,
                               sx + (size_t)r * groups + blocked / 32, some, &acc[r]);
    }
    __m512 v[8];
    for (int r = 0; r < 8; r++) v[r] = r < rows ? _mm512_add_ps(acc[r], tail[r]) : _mm512_setzero_ps();
    float sums[8]; /* dot_four's order, four rows at a time: a row's bits whatever the tile */
    _mm_storeu_ps(sums, sum_four(v[0], v[1], v[2], v[3]));
    if (rows > 4) _mm_storeu_ps(sums + 4, sum_four(v[4], v[5], v[6], v[7]));
    for (int r = 0; r < rows; r++) out[r] = sums[r];
}
#elif defined(PATH_256)
static inline __m256i dot_bytes(__m256i q, __m256i xv) {
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), q, xv);
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), q, xv);
#else
    /* q <= 15, |xq| <= 127: a pair's sum fits 16 bits without saturating */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), _mm256_set1_epi16(1));
#endif
}

static inline __m256 two_floats(const float *ab) {
    double both;
    memcpy(&both, ab, 8);
    return _mm256_castpd_ps(_mm256_set1_pd(both));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* eight bfloat16 as floats */
static inline __m256 widen8(const uint16_t *h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)h)), 16));
}

/* groups g..g+7 of one output: their scales into *s, their offsets' factors m = z - 8 s returned */
static inline __m256 scales8(const void *sz, int fmt, int groups, int g, __m256 *s) {
    if (fmt == SCALES_F32) {
        *s = _mm256_loadu_ps((const float *)sz + g);
        return _mm256_loadu_ps((const float *)sz + groups + g);
    }
    if (fmt == SCALES_F16) {
#if defined(__F16C__)
        *s = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)sz + g)));
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)sz + groups + g)));
#else
        float a[8], b[8];
        for (int i = 0; i < 8; i++) a[i] = half_at(sz, fmt, g + i), b[i] = half_at(sz, fmt, groups + g + i);
        *s = _mm256_loadu_ps(a);
        return _mm256_loadu_ps(b);
#endif
    }
    *s = widen8((const uint16_t *)sz + g);
    return _mm256_fnmadd_ps(_mm256_set1_ps(8.0f), *s, widen8((const uint16_t *)sz + groups + g));
}

/* Half a block at a time: its 8 vectors' halves (groups 0..7, then 8..15) summed per group, as the AVX512 path sums
 * whole vectors; a tail pair 32 of its weights at a time (16 of each group), each lane with its group's s d. */
static inline __attribute__((always_inline)) void dot_rows(int rows, int j, const uint8_t *w, const void *sz,
                                                           int fmt, int k, const int8_t *xq, const float *dx, const float *sx,
                                                           float *out) {
    const int groups = k / 32, blocked = k / BLOCK * BLOCK, pairs = tail_pairs(k);
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256 acc[ROW_TILE];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    const uint8_t *blocks = blocks_at(w, j, k);
    for (int b = 0; b < blocked; b += BLOCK)
        for (int half = 0; half < 2; half++) {
            const int g = b / 32 + 8 * half;
            __m256i q[8];
            for (int c = 0; c < 4; c++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(blocks + b / 2 + 64 * c + 32 * half));
                q[c] = _mm256_and_si256(v, nibble);
                q[c + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            }
            __m256 s;
            const __m256 m = scales8(sz, fmt, groups, g, &s);
            for (int r = 0; r < rows; r++) {
                const int8_t *x = xq + (size_t)r * k + b + 32 * half;
                __m256i dot = dot_bytes(q[0], _mm256_loadu_si256((const __m256i *)x));
                for (int v = 1; v < 8; v++)
                    dot = _mm256_add_epi32(dot, dot_bytes(q[v], _mm256_loadu_si256((const __m256i *)(x + 64 * v))));
                const __m256 d = _mm256_loadu_ps(dx + (size_t)r * groups + g);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s, d), acc[r]);
                acc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(sx + (size_t)r * groups + g), acc[r]);
            }
        }
    float offsets[ROW_TILE] = {0.0f}, sd[ROW_TILE][MAX_TAIL];
    for (int g = blocked / 32; g < groups; g++) {
        const float scale = scale_at(sz, fmt, g), m = factor_at(sz, fmt, groups, g);
        for (int r = 0; r < rows; r++) {
            sd[r][g - blocked / 32] = scale * dx[(size_t)r * groups + g];
            offsets[r] += m * sx[(size_t)r * groups + g];
        }
    }
    const uint8_t *t = tail_at(w, j, k);
    for (int p = 0; p < pairs; p++)
        for (int half = 0; half < 2; half++) { /* 16 bytes per half, widened into the activations' order */
            const __m256i v = _mm256_cvtepu32_epi64(_mm_loadu_si128((const __m128i *)(t + 32 * p + 16 * half)));
            const __m256i q = _mm256_and_si256(_mm256_or_si256(v, _mm256_slli_epi64(v, 28)), nibble);
            for (int r = 0; r < rows; r++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + (size_t)r * k + blocked + 64 * p + 32 * half));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_bytes(q, x)), two_floats(sd[r] + 2 * p), acc[r]);
            }
        }
    for (int r = 0; r < rows; r++) out[r] = hsum256(acc[r]) + offsets[r];
}
#else
/* the level of output j's weight for input i (w: its k / 2 bytes) */
static inline int level(const uint8_t *w, int j, int k, int i) {
    const int blocked = k / BLOCK * BLOCK;
    if (i < blocked) { /* vector v = (i % 32) / 4 of its block: 64 bytes v % 4, nibble v / 4, its group's lane */
        const int r = i % BLOCK, v = r % 32 / 4;
        return (blocks_at(w, j, k)[i / BLOCK * (BLOCK / 2) + 64 * (v % 4) + 4 * (r / 32) + r % 4] >> (4 * (v / 4))) & 0x0F;
    }
    const int r = (i - blocked) % 64;
    return (tail_at(w, j, k)[(i - blocked) / 64 * 32 + r % 32] >> (4 * (r / 32))) & 0x0F;
}

static inline void dot_rows(int rows, int j, const uint8_t *w, const void *sz, int fmt, int k, const int8_t *xq,
                            const float *dx, const float *sx, float *out) {
    const int groups = k / 32;
    for (int r = 0; r < rows; r++) {
        float acc = 0.0f, offsets = 0.0f;
        for (int g = 0; g < groups; g++) {
            int32_t dot = 0;
            for (int i = 32 * g; i < 32 * g + 32; i++) dot += level(w, j, k, i) * xq[(size_t)r * k + place(i, k)];
            acc += (float)dot * (scale_at(sz, fmt, g) * dx[(size_t)r * groups + g]);
            offsets += factor_at(sz, fmt, groups, g) * sx[(size_t)r * groups + g];
        }
        out[r] = acc + offsets;
    }
}
#endif

/* Asks for the weights, scales and offsets of outputs [j, j + count) to be brought toward the caches: the processor's
 * own prefetcher starts too late for the short rows of a decode step's matrices (bench/HISTORY.md, "the int4 kernel
 * waited on memory": the built-in model's one-row step's matrices in 8.4 against 10.3 ms). Past the last output it
 * asks for bytes beyond the matrix, which a prefetch may: it never faults (the addresses are made as integers, not
 * pointers, for C's sake).
 * No bounds test here: GCC deletes prefetch loops behind one (12.2, -O1 and up). */
#define PREFETCH 8 /* outputs ahead */
static inline void prefetch_outputs(const uint8_t *w, const void *sz, int fmt, int k, int j, int count) {
    const int bytes = fmt == SCALES_F32 ? k / 4 : k / 8; /* an output's scales and offsets */
    const uintptr_t wj = (uintptr_t)w + (uintptr_t)j * (k / 2), szj = (uintptr_t)sz + (uintptr_t)j * bytes;
    for (int b = 0; b < count * (k / 2); b += 64) __builtin_prefetch((const void *)(wj + b));
    for (int b = 0; b < count * bytes; b += 64) __builtin_prefetch((const void *)(szj + b));
}

/* y (rows x n) = x (rows x k) W^T + bias (NULL: none). w: n x k/2 bytes; sz: n x 2 x k/32 bfloat16 (scales, offsets)
 * or, fmt, float32 (scales, offsets' factors). k must be a multiple of 64; threads: how many OpenMP threads share the
 * outputs (the stage's torch threads). Returns 0; -1 where scratch memory could not be had, -2 where k is not a
 * multiple of 64 (y untouched). */
static int int4_mm(const float *x, int rows, int k, int n, const uint8_t *w, const void *sz, int fmt,
                   const float *bias, float *y, int threads) {
    if (threads < 1) threads = 1;
    if (k % 64) return -2;
    const int groups = k / 32;
    /* the activations' scratch: kept per calling thread, grown as needed */
    static __thread void *scratch = NULL;
    static __thread size_t held = 0;
    const size_t need = (size_t)rows * k + 2 * sizeof(float) * (size_t)rows * groups;
    if (need > held) {
        void *grown = realloc(scratch, need);
        if (!grown) return -1;
        scratch = grown;
        held = need;
    }
    float *dx = scratch, *sx = dx + (size_t)rows * groups;
    int8_t *xq = (int8_t *)(sx + (size_t)rows * groups);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows >= 8)
    for (int r = 0; r < rows; r++)
        quantize_row(x + (size_t)r * k, k, xq + (size_t)r * k, dx + (size_t)r * groups, sx + (size_t)r * groups);

    const int blocks = (n + OUT_BLOCK - 1) / OUT_BLOCK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int block = 0; block < blocks; block++) {
        const int first = block * OUT_BLOCK, last = first + OUT_BLOCK < n ? first + OUT_BLOCK : n;
        float out[ROW_TILE > 4 ? ROW_TILE : 4];
        for (int r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int tile = rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE;
            const int8_t *xt = xq + (size_t)r0 * k;
            const float *dt = dx + (size_t)r0 * groups, *st = sx + (size_t)r0 * groups;
            int j = first;
#if defined(PATH_512)
            if (tile == 1)
                for (; j + FOUR <= last; j += FOUR) {
                    prefetch_outputs(w, sz, fmt, k, j + PREFETCH, FOUR);
                    dot_four(j, w + (size_t)j * (k / 2), scales_of(sz, fmt, j, k), fmt, k, xt, dt, st, out);
                    for (int o = 0; o < FOUR; o++) y[(size_t)r0 * n + j + o] = out[o] + (bias ? bias[j + o] : 0.0f);
                }
#endif
            for (; j < last; j++) {
                if (r0 == 0) prefetch_outputs(w, sz, fmt, k, j + PREFETCH, 1);
                const uint8_t *wj = w + (size_t)j * (k / 2);
                const void *szj = scales_of(sz, fmt, j, k);
                switch (tile) { /* a constant row count, so each case's loops unroll */
                    case 8: dot_rows(8, j, wj, szj, fmt, k, xt, dt, st, out); break;
                    case 7: dot_rows(7, j, wj, szj, fmt, k, xt, dt, st, out); break;
                    case 6: dot_rows(6, j, wj, szj, fmt, k, xt, dt, st, out); break;
                    case 5: dot_rows(5, j, wj, szj, fmt, k, xt, dt, st, out); break;
                    case 4: dot_rows(4, j, wj, szj, fmt, k, xt, dt, st, out); break;
                    case 3: dot_rows(3, j, wj, szj, fmt, k, xt, dt, st, out); break;
                    case 2: dot_rows(2, j, wj, szj, fmt, k, xt, dt, st, out); break;
                    default: dot_rows(1, j, wj, szj, fmt, k, xt, dt, st, out); break;
                }
                const float b = bias ? bias[j] : 0.0f;
                for (int r = 0; r < tile; r++) y[(size_t)(r0 + r) * n + j] = out[r] + b;
            }
        }
    }
    return 0;
}

int swarm_int4_mm(const float *x, int rows, int k, int n, const uint8_t *w, const uint16_t *sz, const float *bias,
                  float *y, int threads) {
    return int4_mm(x, rows, k, n, w, sz, 0, bias, y, threads);
}

/* swarm_int4_mm with float32 (fmt SCALES_F32) or float16 (SCALES_F16) scales and offsets' factors: w = q s + m */
int swarm_int4_mm_exact(const float *x, int rows, int k, int n, const uint8_t *w, const void *sm, int fmt,
                        const float *bias, float *y, int threads) {
    if (fmt != SCALES_F32 && fmt != SCALES_F16) return -3;
    return int4_mm(x, rows, k, n, w, sm, fmt, bias, y, threads);
}

/* --- a decoder layer's step for rows that are each one request's next token ---------------------------------------
 *
 * The int4-fast layers of the Llama family (Llama, Mistral without windows, Qwen2, Qwen3) for rows that attend to
 * their own request's cached keys and values: the step a decode pass makes, in two calls
 * (swarm/stage/compiled_decode.py) instead of some thirty torch operations; the first writes the new keys and values
 * into the cache's buffers. */


typedef struct {
    int hidden, heads, kv_heads, head_dim, inter;
    float eps, scaling;
    const float *in_norm, *post_norm, *q_norm, *k_norm; /* q_norm, k_norm: Qwen3's per-head norms, else NULL */
    const uint8_t *w_qkv;
    const uint16_t *s_qkv;
    const float *b_qkv;
    const uint8_t *w_o;
    const uint16_t *s_o;
    const float *b_o;
    const uint8_t *w_gate_up; /* the gate's rows, then the up projection's */
    const uint16_t *s_gate_up;
    const uint8_t *w_down;
    const uint16_t *s_down;
    int scale_format; /* how every s_ above holds its scales: SCALES_BF16, SCALES_F32 or SCALES_F16 */
} swarm_layer;

/* swarm_layer's size, then each field's offset in the order declared: the Python side (compiled_decode._Layer, a ctypes
 * mirror of this struct) refuses to call the layer step where they differ. Writes at most n numbers; returns how many
 * there are. */
int swarm_layer_layout(long long *out, int n) {
    const long long layout[] = {
        sizeof(swarm_layer), offsetof(swarm_layer, hidden), offsetof(swarm_layer, heads),
        offsetof(swarm_layer, kv_heads), offsetof(swarm_layer, head_dim), offsetof(swarm_layer, inter),
        offsetof(swarm_layer, eps), offsetof(swarm_layer, scaling), offsetof(swarm_layer, in_norm),
        offsetof(swarm_layer, post_norm), offsetof(swarm_layer, q_norm), offsetof(swarm_layer, k_norm),
        offsetof(swarm_layer, w_qkv), offsetof(swarm_layer, s_qkv), offsetof(swarm_layer, b_qkv),
        offsetof(swarm_layer, w_o), offsetof(swarm_layer, s_o), offsetof(swarm_layer, b_o),
        offsetof(swarm_layer, w_gate_up), offsetof(swarm_layer, s_gate_up), offsetof(swarm_layer, w_down),
        offsetof(swarm_layer, s_down), offsetof(swarm_layer, scale_format)};
    const int count = (int)(sizeof layout / sizeof layout[0]);
    for (int i = 0; i < count && i < n; i++) out[i] = layout[i];
    return count;
}

static float *layer_scratch(size_t floats) {
    static __thread float *held = NULL;
    static __thread size_t size = 0;
    if (floats > size) {
        float *grown = realloc(held, floats * sizeof(float));
        if (!grown) return NULL;
        held = grown;
        size = floats;
    }
    return held;
}

/* out = x / sqrt(mean(x^2) + eps) * weight, over n values */
/* e^x, 16 at a time where the CPU has AVX512 (a step's SiLU and softmax call it some 70,000 times a row): x = n ln 2 + r,
 * |r| <= ln 2 / 2, e^r by its Taylor polynomial to r^7 (relative error ~1e-7, as libm's expf), times 2^n. Each lane
 * is computed alone: the same input gives the same bits wherever it sits. */
#if defined(PATH_512)
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.0f)), _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}
#endif

/* out = e^x over n floats, as the step's SiLU and softmax compute it (for the tests) */
void swarm_exp(const float *x, int n, float *out) {
    int i = 0;
#if defined(PATH_512)
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(out + i, exp16(_mm512_loadu_ps(x + i)));
#endif
    for (; i < n; i++) out[i] = expf(x[i]);
}

/* m = silu(gate) * up over one row's n pairs (gate: the row's first n of gu, up: the next n) */
static void silu_mul(const float *gu, int n, float *m) {
    int i = 0;
#if defined(PATH_512)
    for (; i < n; i += 16) {
        const __mmask16 some = n - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - i)) - 1);
        const __m512 g = _mm512_maskz_loadu_ps(some, gu + i), u = _mm512_maskz_loadu_ps(some, gu + n + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        _mm512_mask_storeu_ps(m + i, some, _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u));
    }
#endif
    for (; i < n; i++) m[i] = gu[i] / (1.0f + expf(-gu[i])) * gu[n + i];
}

/* p[t] = e^(p[t] - top) for t < n, and their sum */
static float exp_shifted(float *p, int n, float top) {
    int t = 0;
    float total = 0.0f;
#if defined(PATH_512)
    __m512 sum = _mm512_setzero_ps();
    for (; t < n; t += 16) {
        const __mmask16 some = n - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - t)) - 1);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(some, p + t), _mm512_set1_ps(top)));
        _mm512_mask_storeu_ps(p + t, some, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(some, e));
    }
    total = _mm512_reduce_add_ps(sum);
#endif
    for (; t < n; t++) {
        p[t] = expf(p[t] - top);
        total += p[t];
    }
    return total;
}

static void rms_norm(const float *x, int n, const float *weight, float eps, float *out) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < n; i++) sum += x[i] * x[i];
    const float r = 1.0f / sqrtf(sum / (float)n + eps);
#pragma omp simd
    for (int i = 0; i < n; i++) out[i] = x[i] * r * weight[i];
}

/* rotary embedding of one head in place: x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1) */
static void rotate(float *x, const float *cos, const float *sin, int head_dim) {
    const int half = head_dim / 2;
    for (int i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* x: rows x hidden; cos, sin: rows x head_dim; q: rows x heads*head_dim. Row r's keys and values go straight into its
 * request's cache: head h at k_rows[r] + h * spans[r] * head_dim (and v_rows[r] alike) -- the cache's row for that
 * position in a buffer of spans[r] positions per head. */
int swarm_layer_qkv(const swarm_layer *L, const float *x, int rows, const float *cos, const float *sin, float *q,
                    float *const *k_rows, float *const *v_rows, const int *spans, int threads) {
    const int hd = L->head_dim, nq = L->heads * hd, nkv = L->kv_heads * hd, width = nq + 2 * nkv;
    float *h = layer_scratch((size_t)rows * (L->hidden + width));
    if (!h) return -1;
    float *qkv = h + (size_t)rows * L->hidden;
    for (int r = 0; r < rows; r++) rms_norm(x + (size_t)r * L->hidden, L->hidden, L->in_norm, L->eps, h + (size_t)r * L->hidden);
    int status = int4_mm(h, rows, L->hidden, width, L->w_qkv, L->s_qkv, L->scale_format, L->b_qkv, qkv, threads);
    if (status) return status;
    for (int r = 0; r < rows; r++) {
        float *row = qkv + (size_t)r * width;
        float *qr = q + (size_t)r * nq, *kr = row + nq, *vr = row + nq + nkv;
        const size_t stride = (size_t)spans[r] * hd;
        memcpy(qr, row, sizeof(float) * nq);
        for (int head = 0; head < L->heads; head++) {
            if (L->q_norm) rms_norm(qr + head * hd, hd, L->q_norm, L->eps, qr + head * hd);
            rotate(qr + head * hd, cos + (size_t)r * hd, sin + (size_t)r * hd, hd);
        }
        for (int head = 0; head < L->kv_heads; head++) {
            if (L->k_norm) rms_norm(kr + head * hd, hd, L->k_norm, L->eps, kr + head * hd);
            rotate(kr + head * hd, cos + (size_t)r * hd, sin + (size_t)r * hd, hd);
            memcpy(k_rows[r] + head * stride, kr + head * hd, sizeof(float) * hd);
            memcpy(v_rows[r] + head * stride, vr + head * hd, sizeof(float) * hd);
        }
    }
    return 0;
}

/* x (rows x hidden), updated in place: each row's attention -- q (rows x heads*head_dim) against the first
 * lengths[r] of its request's keys and values (kv_heads x spans[r] x head_dim each, the new rows included: several
 * rows of one request share its cache, each seeing the keys up to its own) -- through the output projection, then
 * the MLP, each with its residual. */
int swarm_layer_rest(const swarm_layer *L, float *x, int rows, const float *q, const float *const *keys,
                     const float *const *values, const int *lengths, const int *spans, int threads) {
    if (threads < 1) threads = 1;
    const int hd = L->head_dim, nq = L->heads * hd, groups = L->heads / L->kv_heads, hidden = L->hidden;
    int longest = 1;
    for (int r = 0; r < rows; r++) longest = lengths[r] > longest ? lengths[r] : longest;
    const size_t attn = (size_t)rows * nq, scores = (size_t)threads * longest, normed = (size_t)rows * hidden;
    const size_t gate_up = (size_t)rows * 2 * L->inter, act = (size_t)rows * L->inter, out = (size_t)rows * hidden;
    float *a = layer_scratch(attn + scores + normed + gate_up + act + out);
    if (!a) return -1;
    float *s = a + attn, *h = s + scores, *gu = h + normed, *m = gu + gate_up, *o = m + act;
    const int tasks = rows * L->heads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int task = 0; task < tasks; task++) {
        const int r = task / L->heads, head = task % L->heads, n = lengths[r];
        const size_t span = (size_t)spans[r];
        const float *qh = q + (size_t)r * nq + (size_t)head * hd;
        const float *kh = keys[r] + (size_t)(head / groups) * span * hd;
        const float *vh = values[r] + (size_t)(head / groups) * span * hd;
        float *p = s + (size_t)omp_get_thread_num() * longest, *out_h = a + (size_t)r * nq + (size_t)head * hd;
        float top = -INFINITY;
        for (int t = 0; t < n; t++) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int i = 0; i < hd; i++) dot += qh[i] * kh[(size_t)t * hd + i];
            p[t] = dot * L->scaling;
            top = p[t] > top ? p[t] : top;
        }
        const float inv = 1.0f / exp_shifted(p, n, top);
        for (int i = 0; i < hd; i++) out_h[i] = 0.0f;
        for (int t = 0; t < n; t++) {
            const float weight = p[t] * inv;
#pragma omp simd
            for (int i = 0; i < hd; i++) out_h[i] += weight * vh[(size_t)t * hd + i];
        }
    }
    int status = int4_mm(a, rows, nq, hidden, L->w_o, L->s_o, L->scale_format, L->b_o, o, threads);
    if (status) return status;
    for (size_t i = 0; i < out; i++) x[i] += o[i];
    for (int r = 0; r < rows; r++) rms_norm(x + (size_t)r * hidden, hidden, L->post_norm, L->eps, h + (size_t)r * hidden);
    status = int4_mm(h, rows, hidden, 2 * L->inter, L->w_gate_up, L->s_gate_up, L->scale_format, NULL, gu, threads);
    if (status) return status;
    for (int r = 0; r < rows; r++) silu_mul(gu + (size_t)r * 2 * L->inter, L->inter, m + (size_t)r * L->inter);
    status = int4_mm(m, rows, L->inter, hidden, L->w_down, L->s_down, L->scale_format, NULL, o, threads);
    if (status) return status;
    for (size_t i = 0; i < out; i++) x[i] += o[i];
    return 0;
}
