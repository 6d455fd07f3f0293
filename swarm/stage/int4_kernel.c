/* swarm's int4 matrix kernel for CPUs: y = x W^T (+ b), with W in 4 bits and x quantized to 8 bits as it comes in,
 * the scheme of llama.cpp's Q4 x Q8 dot products (swarm/stage/int4_kernel.py builds and loads this file).
 *
 * W (n outputs x k inputs): groups of 32 inputs, each with a bfloat16 scale s and offset z (w = (q - 8) s + z, q in
 * 0..15 -- the grid of swarm.stage.quantize's Int4Linear). Two neighbouring groups make a pair (64 inputs), and an
 * output's pairs are stored two at a time: 64 bytes hold pair 2c in their low nibbles and pair 2c + 1 in their high
 * ones, byte b holding the weight that meets byte b of the pair's quantized activations (the order lane_of gives), so
 * one load and a mask or a shift unpack 64 weights. An odd last pair is stored alone in 32 bytes (byte j: q[j] low,
 * q[j + 32] high), after the others for even outputs and before them for odd ones: an output then takes k / 2 bytes
 * and, from 64-byte aligned memory, its two-pair blocks never straddle a cache line. An output's scales are stored
 * before its offsets.
 *
 * x (rows x k, float32): each row's groups of 32 quantized alone, d = max|x| / 127, xq = round(x / d), so a row's
 * result never depends on the other rows of the call (a batch computes each chat's row as it would alone).
 *
 *   y = sum over groups of  s d (q . xq)  +  (z - 8 s) sum(x)
 *
 * q . xq is an unsigned-by-signed byte dot product: one VNNI instruction per 64 weights where the CPU has AVX512-VNNI,
 * AVX2's multiply-adds elsewhere on x86-64, plain C on other processors. Each output is summed by one thread in a
 * fixed order: the same inputs give the same bits, whatever the thread count. Outputs are split over OpenMP threads
 * (torch's own runtime: libgomp is loaded once per process).
 */
#include <math.h>
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
#define MAX_GROUPS 1024 /* k up to 32768 */

const char *swarm_int4_path(void) { return PATH_NAME; }

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

/* The byte of a pair's 64 quantized activations that meets weight j (0..31) of its first group (second: + 4): the
 * packed bytes widen four at a time into alternate 32-bit lanes, the first group's low nibbles then the second's high
 * ones, so the activations are laid out four of the first group, four of the second, and so on. */
static inline int lane_of(int j) { return 8 * (j / 4) + j % 4; }

/* Output j's weights (its k / 2 bytes at wj): the two-pair blocks start at body, an odd last pair is at lone */
static inline const uint8_t *body(const uint8_t *wj, int j, int pairs) { return wj + ((pairs & j & 1) ? 32 : 0); }
static inline const uint8_t *lone(const uint8_t *wj, int j, int pairs) { return wj + ((j & 1) ? 0 : 32 * (pairs - 1)); }

/* One row: xq (k bytes, in the order lane_of gives), d and sum(x) per group of 32 (k / 32 floats each). */
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
    /* four bytes of the first group, four of the second, ...: dwords 0..7 of each group interleaved */
    const __m512i order = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int p = 0; p < k / 64; p++) {
        __m512i a, b;
        quantize_group(x + 64 * p, &a, dx + 2 * p, sx + 2 * p);
        quantize_group(x + 64 * p + 32, &b, dx + 2 * p + 1, sx + 2 * p + 1);
        _mm512_storeu_si512((void *)(xq + 64 * p), _mm512_permutex2var_epi32(a, order, b));
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
        int8_t *out = xq + 64 * (g / 2) + 4 * (g % 2);
        for (int i = 0; i < 32; i++) {
            float r = rintf(v[i] * inv);
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            out[lane_of(i)] = (int8_t)r;
        }
        dx[g] = d;
        sx[g] = sum;
    }
}
#endif

/* w: one output's k / 2 packed bytes; sz: its k / 32 scales then its k / 32 offsets, in bfloat16; xq, dx, sx: `rows`
 * rows of quantized activations (k, k / 32 and k / 32 apart); sf: scratch for k / 32 floats per row, MAX_GROUPS
 * apart; out: a result per row. Each output first multiplies its scales by each row's, s d, and sums its offsets'
 * term, (z - 8 s) sum(x) over the groups, so the loop over the weights has only the dot products and one multiply-add
 * left (s d is the same float product the loop would make: the same bits). */
#if defined(PATH_512)
static inline __m512 two_floats(const float *ab) {
    double both;
    memcpy(&both, ab, 8);
    return _mm512_castpd_ps(_mm512_set1_pd(both));
}

/* groups g.. (those in `some`) of one output: their scales s as floats into *scales, and z - 8 s returned */
static inline __m512 widen_scales(const uint16_t *sz, int groups, int g, __mmask16 some, __m512 *scales) {
    *scales = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(some, sz + g)), 16));
    const __m512 z = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(some, sz + groups + g)), 16));
    return _mm512_fnmadd_ps(_mm512_set1_ps(8.0f), *scales, z);
}

/* two pairs' 128 weights from a 64-byte block: the first pair's in the low nibbles, the second's in the high ones */
static inline void unpack_two_pairs(const uint8_t *block, __m512i *first, __m512i *second) {
    const __m512i v = _mm512_loadu_si512((const void *)block), nibble = _mm512_set1_epi8(0x0F);
    *first = _mm512_and_si512(v, nibble);
    *second = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
}

/* a lone pair's 64 weights from its 32 bytes, widened into the activations' order */
static inline __m512i unpack_pair(const uint8_t *w) {
    const __m512i v = _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)w));
    return _mm512_and_si512(_mm512_or_si512(v, _mm512_slli_epi64(v, 28)), _mm512_set1_epi8(0x0F));
}

/* acc + s d (q . x) over one pair's lanes: q its 64 weights, x the row's 64 activations, sd the pair's two s d */
static inline __m512 add_pair(__m512 acc, __m512i q, __m512i x, const float *sd) {
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), q, x)), two_floats(sd), acc);
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

/* One row against four outputs at once (a decode step's case): each pair's activations are loaded once for the four.
 * w, sz: output j's; the others follow at k / 2 bytes and k / 16 scales apart. */
#define FOUR 4
static inline void dot_four(int j, const uint8_t *w, const uint16_t *sz, int k, const int8_t *xq, const float *dx,
                            const float *sx, float *sf, float *out) {
    const int pairs = k / 64, groups = k / 32;
    __m512 acc[FOUR], offsets[FOUR];
    for (int o = 0; o < FOUR; o++) {
        offsets[o] = _mm512_setzero_ps();
        for (int g = 0; g < groups; g += 16) {
            const __mmask16 some = groups - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (groups - g)) - 1);
            __m512 scales;
            const __m512 m = widen_scales(sz + (size_t)o * (k / 16), groups, g, some, &scales);
            _mm512_storeu_ps(sf + o * MAX_GROUPS + g, _mm512_mul_ps(scales, _mm512_maskz_loadu_ps(some, dx + g)));
            offsets[o] = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(some, sx + g), offsets[o]);
        }
        acc[o] = _mm512_setzero_ps();
    }
    int p = 0;
    for (; p + 2 <= pairs; p += 2) {
        const __m512i x0 = _mm512_loadu_si512((const void *)(xq + 64 * p));
        const __m512i x1 = _mm512_loadu_si512((const void *)(xq + 64 * p + 64));
        for (int o = 0; o < FOUR; o++) {
            __m512i q0, q1;
            unpack_two_pairs(body(w + (size_t)o * (k / 2), j + o, pairs) + 32 * p, &q0, &q1);
            const float *so = sf + o * MAX_GROUPS + 2 * p;
            acc[o] = add_pair(add_pair(acc[o], q0, x0, so), q1, x1, so + 2);
        }
    }
    if (p < pairs) {
        const __m512i xv = _mm512_loadu_si512((const void *)(xq + 64 * p));
        for (int o = 0; o < FOUR; o++) {
            const __m512i q = unpack_pair(lone(w + (size_t)o * (k / 2), j + o, pairs));
            acc[o] = add_pair(acc[o], q, xv, sf + o * MAX_GROUPS + 2 * p);
        }
    }
    _mm_storeu_ps(out, sum_four(_mm512_add_ps(acc[0], offsets[0]), _mm512_add_ps(acc[1], offsets[1]),
                                _mm512_add_ps(acc[2], offsets[2]), _mm512_add_ps(acc[3], offsets[3])));
}

static inline __attribute__((always_inline)) void dot_rows(int rows, int j, const uint8_t *w, const uint16_t *sz,
                                                           int k, const int8_t *xq, const float *dx, const float *sx,
                                                           float *sf, float *out) {
    const int pairs = k / 64, groups = k / 32;
    __m512 acc[ROW_TILE], offsets[ROW_TILE];
    for (int r = 0; r < rows; r++) offsets[r] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g += 16) {
        const __mmask16 some = groups - g >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (groups - g)) - 1);
        __m512 scales;
        const __m512 m = widen_scales(sz, groups, g, some, &scales);
        for (int r = 0; r < rows; r++) {
            const __m512 d = _mm512_maskz_loadu_ps(some, dx + (size_t)r * groups + g);
            _mm512_storeu_ps(sf + r * MAX_GROUPS + g, _mm512_mul_ps(scales, d));
            offsets[r] = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(some, sx + (size_t)r * groups + g), offsets[r]);
        }
    }
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    int p = 0;
    for (; p + 2 <= pairs; p += 2) {
        __m512i q0, q1;
        unpack_two_pairs(body(w, j, pairs) + 32 * p, &q0, &q1);
        for (int r = 0; r < rows; r++) {
            const int8_t *xr = xq + (size_t)r * k + 64 * p;
            const float *sr = sf + r * MAX_GROUPS + 2 * p;
            const __m512i x0 = _mm512_loadu_si512((const void *)xr), x1 = _mm512_loadu_si512((const void *)(xr + 64));
            acc[r] = add_pair(add_pair(acc[r], q0, x0, sr), q1, x1, sr + 2);
        }
    }
    if (p < pairs) {
        const __m512i q = unpack_pair(lone(w, j, pairs));
        for (int r = 0; r < rows; r++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(xq + (size_t)r * k + 64 * p));
            acc[r] = add_pair(acc[r], q, xv, sf + r * MAX_GROUPS + 2 * p);
        }
    }
    __m512 v[8];
    for (int r = 0; r < 8; r++) v[r] = r < rows ? _mm512_add_ps(acc[r], offsets[r]) : _mm512_setzero_ps();
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

/* one pair's half (32 weights of each group, 4 and 4 in turn) against each row's: acc[r] += s d (q . xq) */
static inline __attribute__((always_inline)) void dot_half(int rows, __m256i q, const int8_t *xq, int k, int p,
                                                           int half, const float *sf, __m256 *acc) {
    for (int r = 0; r < rows; r++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (size_t)r * k + 64 * p + 32 * half));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_bytes(q, xv)), two_floats(sf + r * MAX_GROUPS + 2 * p), acc[r]);
    }
}

static inline __attribute__((always_inline)) void dot_rows(int rows, int j, const uint8_t *w, const uint16_t *sz,
                                                           int k, const int8_t *xq, const float *dx, const float *sx,
                                                           float *sf, float *out) {
    const int pairs = k / 64, groups = k / 32;
    float offsets[ROW_TILE] = {0.0f};
    for (int g = 0; g < groups; g++) {
        const float scale = bf16_to_float(sz[g]), m = bf16_to_float(sz[groups + g]) - 8.0f * scale;
        for (int r = 0; r < rows; r++) {
            sf[r * MAX_GROUPS + g] = scale * dx[(size_t)r * groups + g];
            offsets[r] += m * sx[(size_t)r * groups + g];
        }
    }
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    __m256 acc[ROW_TILE];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    int p = 0;
    for (; p + 2 <= pairs; p += 2) { /* a two-pair block: each 32 bytes hold a half of both pairs */
        const uint8_t *block = body(w, j, pairs) + 32 * p;
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)block);
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(block + 32));
        dot_half(rows, _mm256_and_si256(v0, nibble), xq, k, p, 0, sf, acc);
        dot_half(rows, _mm256_and_si256(v1, nibble), xq, k, p, 1, sf, acc);
        dot_half(rows, _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble), xq, k, p + 1, 0, sf, acc);
        dot_half(rows, _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble), xq, k, p + 1, 1, sf, acc);
    }
    if (p < pairs) /* a lone pair: 16 bytes per half, widened into the activations' order */
        for (int half = 0; half < 2; half++) {
            const __m256i v = _mm256_cvtepu32_epi64(_mm_loadu_si128((const __m128i *)(lone(w, j, pairs) + 16 * half)));
            const __m256i q = _mm256_and_si256(_mm256_or_si256(v, _mm256_slli_epi64(v, 28)), nibble);
            dot_half(rows, q, xq, k, p, half, sf, acc);
        }
    for (int r = 0; r < rows; r++) out[r] = hsum256(acc[r]) + offsets[r];
}
#else
static inline void dot_rows(int rows, int j, const uint8_t *w, const uint16_t *sz, int k, const int8_t *xq,
                            const float *dx, const float *sx, float *sf, float *out) {
    const int pairs = k / 64, groups = k / 32;
    (void)sf;
    for (int r = 0; r < rows; r++) {
        float acc = 0.0f, offsets = 0.0f;
        for (int g = 0; g < groups; g++) {
            const int p = g / 2, second = g % 2;
            const int8_t *v = xq + (size_t)r * k + 64 * p + 4 * second;
            int32_t dot = 0;
            if (p < (pairs & ~1)) { /* in a two-pair block: at its activation's byte, in the pair's nibble */
                const uint8_t *b = body(w, j, pairs) + 64 * (p / 2) + 4 * second;
                for (int i = 0; i < 32; i++) dot += ((b[lane_of(i)] >> (4 * (p % 2))) & 0x0F) * v[lane_of(i)];
            } else { /* the lone pair: byte i holds weights i and i + 32 */
                const uint8_t *b = lone(w, j, pairs);
                for (int i = 0; i < 32; i++) dot += ((b[i] >> (4 * second)) & 0x0F) * v[lane_of(i)];
            }
            const float scale = bf16_to_float(sz[g]);
            acc += (float)dot * (scale * dx[(size_t)r * groups + g]);
            offsets += (bf16_to_float(sz[groups + g]) - 8.0f * scale) * sx[(size_t)r * groups + g];
        }
        out[r] = acc + offsets;
    }
}
#endif

/* Asks for the weights, scales and offsets of outputs [j, j + count) to be brought toward the caches: the processor's
 * own prefetcher starts too late for the short rows of a decode step's matrices (bench/RESULTS.md, "the int4 kernel
 * waited on memory": the built-in model's one-row step's matrices in 8.4 against 10.3 ms). Past the last output it
 * asks for bytes beyond the matrix, which a prefetch may: it never faults (the addresses are made as integers, not
 * pointers, for C's sake).
 * No bounds test here: GCC deletes prefetch loops behind one (12.2, -O1 and up). */
#define PREFETCH 8 /* outputs ahead */
static inline void prefetch_outputs(const uint8_t *w, const uint16_t *sz, int k, int j, int count) {
    const uintptr_t wj = (uintptr_t)w + (uintptr_t)j * (k / 2), szj = (uintptr_t)sz + (uintptr_t)j * (k / 8);
    for (int b = 0; b < count * (k / 2); b += 64) __builtin_prefetch((const void *)(wj + b));
    for (int b = 0; b < count * (k / 8); b += 64) __builtin_prefetch((const void *)(szj + b));
}

/* y (rows x n) = x (rows x k) W^T + bias (NULL: none). w: n x k/2 bytes; sz: n x k/32 x 2 bfloat16 (scale, offset).
 * k must be a multiple of 64; threads: how many OpenMP threads share the outputs (the stage's torch threads). Returns 0, or -1 where scratch memory could not be had (y untouched). */
int swarm_int4_mm(const float *x, int rows, int k, int n, const uint8_t *w, const uint16_t *sz, const float *bias,
                  float *y, int threads) {
    if (threads < 1) threads = 1;
    if (k % 64 || k / 32 > MAX_GROUPS) return -2;
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
        float out[ROW_TILE > 4 ? ROW_TILE : 4], sf[ROW_TILE * MAX_GROUPS + 16]; /* + 16: whole-vector stores */
        for (int r0 = 0; r0 < rows; r0 += ROW_TILE) {
            const int tile = rows - r0 < ROW_TILE ? rows - r0 : ROW_TILE;
            const int8_t *xt = xq + (size_t)r0 * k;
            const float *dt = dx + (size_t)r0 * groups, *st = sx + (size_t)r0 * groups;
            int j = first;
#if defined(PATH_512)
            if (tile == 1)
                for (; j + FOUR <= last; j += FOUR) {
                    prefetch_outputs(w, sz, k, j + PREFETCH, FOUR);
                    dot_four(j, w + (size_t)j * (k / 2), sz + (size_t)j * (k / 16), k, xt, dt, st, sf, out);
                    for (int o = 0; o < FOUR; o++) y[(size_t)r0 * n + j + o] = out[o] + (bias ? bias[j + o] : 0.0f);
                }
#endif
            for (; j < last; j++) {
                if (r0 == 0) prefetch_outputs(w, sz, k, j + PREFETCH, 1);
                const uint8_t *wj = w + (size_t)j * (k / 2);
                const uint16_t *szj = sz + (size_t)j * (k / 16);
                switch (tile) { /* a constant row count, so each case's loops unroll */
                    case 8: dot_rows(8, j, wj, szj, k, xt, dt, st, sf, out); break;
                    case 7: dot_rows(7, j, wj, szj, k, xt, dt, st, sf, out); break;
                    case 6: dot_rows(6, j, wj, szj, k, xt, dt, st, sf, out); break;
                    case 5: dot_rows(5, j, wj, szj, k, xt, dt, st, sf, out); break;
                    case 4: dot_rows(4, j, wj, szj, k, xt, dt, st, sf, out); break;
                    case 3: dot_rows(3, j, wj, szj, k, xt, dt, st, sf, out); break;
                    case 2: dot_rows(2, j, wj, szj, k, xt, dt, st, sf, out); break;
                    default: dot_rows(1, j, wj, szj, k, xt, dt, st, sf, out); break;
                }
                const float b = bias ? bias[j] : 0.0f;
                for (int r = 0; r < tile; r++) y[(size_t)(r0 + r) * n + j] = out[r] + b;
            }
        }
    }
    return 0;
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
} swarm_layer;

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
    int status = swarm_int4_mm(h, rows, L->hidden, width, L->w_qkv, L->s_qkv, L->b_qkv, qkv, threads);
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
        float total = 0.0f;
        for (int t = 0; t < n; t++) {
            p[t] = expf(p[t] - top);
            total += p[t];
        }
        const float inv = 1.0f / total;
        for (int i = 0; i < hd; i++) out_h[i] = 0.0f;
        for (int t = 0; t < n; t++) {
            const float weight = p[t] * inv;
#pragma omp simd
            for (int i = 0; i < hd; i++) out_h[i] += weight * vh[(size_t)t * hd + i];
        }
    }
    int status = swarm_int4_mm(a, rows, nq, hidden, L->w_o, L->s_o, L->b_o, o, threads);
    if (status) return status;
    for (size_t i = 0; i < out; i++) x[i] += o[i];
    for (int r = 0; r < rows; r++) rms_norm(x + (size_t)r * hidden, hidden, L->post_norm, L->eps, h + (size_t)r * hidden);
    status = swarm_int4_mm(h, rows, hidden, 2 * L->inter, L->w_gate_up, L->s_gate_up, NULL, gu, threads);
    if (status) return status;
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < L->inter; i++) {
            const float g = gu[(size_t)r * 2 * L->inter + i], u = gu[(size_t)r * 2 * L->inter + L->inter + i];
            m[(size_t)r * L->inter + i] = g / (1.0f + expf(-g)) * u;
        }
    status = swarm_int4_mm(m, rows, L->inter, hidden, L->w_down, L->s_down, NULL, o, threads);
    if (status) return status;
    for (size_t i = 0; i < out; i++) x[i] += o[i];
    return 0;
}
