/* Prototype: order-0 static rANS, 32 interleaved 32-bit states, 12-bit probabilities, 16-bit
 * renormalisation; scalar and AVX2 encoders, AVX2 and AVX-512 decoders. Question: how fast can a
 * compiled SIMD coder code the dense frames' code pairs on this machine, against zstd's Huffman?
 * A prototype for experiments/rans_pairs.py: it decodes only streams its own encoder wrote (no
 * checks against hostile input; the decoders read up to 16 bytes past a stream). */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define SCALE 12
#define TOT (1u << SCALE)
#define LOW (1u << 15)  /* states live in [LOW, 2^31): the encoder's reciprocals are exact there */
#define LANES 32

/* counts[256] of in[0..n): four interleaved tables, so repeated symbols do not chain their increments. */
void rans_count(const uint8_t *in, uint32_t n, uint32_t *counts) {
    uint32_t t[4][256];
    memset(t, 0, sizeof t);
    uint32_t i = 0;
    for (; i + 4 <= n; i += 4) {
        t[0][in[i]]++; t[1][in[i + 1]]++; t[2][in[i + 2]]++; t[3][in[i + 3]]++;
    }
    for (; i < n; i++) t[0][in[i]]++;
    for (int s = 0; s < 256; s++) counts[s] = t[0][s] + t[1][s] + t[2][s] + t[3][s];
}

/* counts[256] -> freq[256] summing to TOT, every present symbol >= 1, none == TOT. */
int rans_normalise(const uint32_t *counts, uint32_t n, uint16_t *freq) {
    uint32_t sum = 0, best = 0, present = 0;
    for (int s = 0; s < 256; s++) {
        uint32_t f = counts[s] ? (uint32_t)(((uint64_t)counts[s] * TOT + n / 2) / n) : 0;
        if (counts[s] && f == 0) f = 1;
        freq[s] = (uint16_t)f;
        sum += f;
        if (counts[s]) present++;
        if (f > freq[best]) best = s;
    }
    if (present < 2) return -1;
    /* fix the total on the most frequent symbol */
    int32_t diff = (int32_t)TOT - (int32_t)sum;
    if ((int32_t)freq[best] + diff < 1) return -2;
    freq[best] = (uint16_t)(freq[best] + diff);
    if (freq[best] >= TOT) return -3;
    return 0;
}

/* What encoding symbol s needs, division by reciprocal multiplication (as in ryg's rans_byte.h:
 * exact for states < 2^31): x' = x + bias + (mulhi(x, rcp) >> shift) * cmpl, where cmpl = TOT - f.
 * info packs bias (13 bits) | cmpl << 13 (12 bits) | shift << 25 (5 bits). */
static void encoder_tables(const uint16_t *freq, uint32_t *rcp, uint32_t *info) {
    uint32_t start = 0;
    for (int s = 0; s < 256; s++) {
        uint32_t f = freq[s], bias = start, shift = 0;
        if (f < 2) {
            rcp[s] = ~0u; bias = start + TOT - 1;
        } else {
            uint32_t sh = 0;
            while (f > (1u << sh)) sh++;
            rcp[s] = (uint32_t)(((1ull << (sh + 31)) + f - 1) / f);
            shift = sh - 1;
        }
        info[s] = bias | (TOT - f) << 13 | shift << 25;
        start += f;
    }
}

/* The encode4 layout from the final states and the streams [ptr[v], top[v]); -1 if over cap. */
static int64_t write_layout(const uint32_t *x, uint16_t *const *top, uint16_t *const *ptr, uint8_t *out, uint64_t cap) {
    uint64_t need = 128 + 16;
    for (int v = 0; v < 4; v++) need += (uint64_t)(top[v] - ptr[v]) * 2;
    if (need > cap) return -1;
    memcpy(out, x, 128);
    uint8_t *o = out + 144;
    for (int v = 0; v < 4; v++) {
        uint32_t words = (uint32_t)(top[v] - ptr[v]);
        memcpy(out + 128 + 4 * v, &words, 4);
        memcpy(o, ptr[v], (uint64_t)words * 2);
        o += (uint64_t)words * 2;
    }
    return (int64_t)need;
}

/* Encoder of every variant: the lanes' words in 32 / group streams (lanes 0..group-1, ...), so
 * the vectors' renorm reads need not chain. Layout: 32 states (u32), 4 stream lengths (u32, in
 * words; unused ones 0), the streams. n % LANES == 0. Returns the bytes written into out, or -1. */
int64_t rans_encode4(const uint8_t *in, uint32_t n, const uint16_t *freq, uint8_t *out, uint64_t cap,
                     uint16_t *scratch /* 4 x (n + 8) words */, int group) {
    uint32_t rcp[256], info[256];
    encoder_tables(freq, rcp, info);
    if (group != 8 && group != 16 && group != 32) return -1;
    int gshift = group == 8 ? 3 : group == 16 ? 4 : 5;
    uint32_t x[LANES];
    for (int j = 0; j < LANES; j++) x[j] = LOW;
    uint16_t *top[4], *ptr[4];
    for (int v = 0; v < 4; v++) top[v] = ptr[v] = scratch + (uint64_t)(v + 1) * (n + 8);
    for (int64_t g = (int64_t)n - LANES; g >= 0; g -= LANES) {  /* groups, last first */
        for (int v = (LANES >> gshift) - 1; v >= 0; v--) {  /* a stream's pointer stays in a register */
            uint16_t *p = ptr[v];
            for (int j = (v + 1) * group - 1; j >= v * group; j--) {
                uint32_t s = in[g + j], xs = x[j], e = info[s];
                uint32_t cmpl = (e >> 13) & (TOT - 1);
                uint32_t emit = xs >= ((LOW >> SCALE) << 16) * (TOT - cmpl);  /* branchless: it mispredicts half the time */
                p[-1] = (uint16_t)xs;
                p -= emit;
                xs >>= emit << 4;
                uint32_t q = (uint32_t)(((uint64_t)xs * rcp[s]) >> 32) >> (e >> 25);
                x[j] = xs + (e & 0x1fff) + q * cmpl;
            }
            ptr[v] = p;
        }
    }
    return write_layout(x, top, ptr, out, cap);
}

/* mask of the lanes that renormalise -> the lanes' words moved to the top popcount slots, in lane order */
static uint32_t compress_hi_lut[256][8];
static int compress_ready = 0;

/* The same stream as rans_encode4 with group 8, each 8-lane vector encoded at once (AVX2): two
 * gathers (rcp, info) per 8 symbols, the renormalising lanes' words compressed into place. */
int64_t rans_encode4_avx2(const uint8_t *in, uint32_t n, const uint16_t *freq, uint8_t *out, uint64_t cap,
                          uint16_t *scratch /* 4 x (n + 8) words */) {
    if (!compress_ready) {
        for (int m = 0; m < 256; m++) {
            int k = 8 - __builtin_popcount(m);
            for (int j = 0; j < 8; j++) compress_hi_lut[m][j] = 0;
            for (int j = 0; j < 8; j++)
                if ((m >> j) & 1) compress_hi_lut[m][k++] = (uint32_t)j;
        }
        compress_ready = 1;
    }
    uint32_t rcp[256], info[256];
    encoder_tables(freq, rcp, info);
    __m256i x[4];
    for (int v = 0; v < 4; v++) x[v] = _mm256_set1_epi32(LOW);
    uint16_t *top[4], *ptr[4];
    for (int v = 0; v < 4; v++) top[v] = ptr[v] = scratch + (uint64_t)(v + 1) * (n + 8);
    const __m256i m12 = _mm256_set1_epi32(TOT - 1), m13 = _mm256_set1_epi32(0x1fff), m16 = _mm256_set1_epi32(0xffff);
    const __m256i tot = _mm256_set1_epi32(TOT);
    for (int64_t g = (int64_t)n - LANES; g >= 0; g -= LANES) {
        for (int v = 3; v >= 0; v--) {
            __m256i sym = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(in + g + 8 * v)));
            __m256i r = _mm256_i32gather_epi32((const int *)rcp, sym, 4);
            __m256i e = _mm256_i32gather_epi32((const int *)info, sym, 4);
            __m256i cmpl = _mm256_and_si256(_mm256_srli_epi32(e, 13), m12);
            __m256i xmax = _mm256_slli_epi32(_mm256_sub_epi32(tot, cmpl), 19);  /* ((LOW >> SCALE) << 16) * f */
            __m256i xs = x[v];
            __m256i emit = _mm256_cmpgt_epi32(xs, _mm256_sub_epi32(xmax, _mm256_set1_epi32(1)));  /* < 2^31: signed is fine */
            int m = _mm256_movemask_ps(_mm256_castsi256_ps(emit));
            __m256i words = _mm256_permutevar8x32_epi32(_mm256_and_si256(xs, m16),
                                                        _mm256_loadu_si256((const __m256i *)compress_hi_lut[m]));
            __m256i w16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(words, words), _MM_SHUFFLE(3, 1, 2, 0));
            _mm_storeu_si128((__m128i *)(ptr[v] - 8), _mm256_castsi256_si128(w16));  /* the slots below are unwritten */
            ptr[v] -= __builtin_popcount(m);
            xs = _mm256_blendv_epi8(xs, _mm256_srli_epi32(xs, 16), emit);
            __m256i even = _mm256_srli_epi64(_mm256_mul_epu32(xs, r), 32);
            __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(xs, 32), _mm256_srli_epi64(r, 32));
            __m256i q = _mm256_srlv_epi32(_mm256_blend_epi32(even, odd, 0xaa), _mm256_srli_epi32(e, 25));
            x[v] = _mm256_add_epi32(_mm256_add_epi32(xs, _mm256_and_si256(e, m13)), _mm256_mullo_epi32(q, cmpl));
        }
    }
    uint32_t states[LANES];
    for (int v = 0; v < 4; v++) _mm256_storeu_si256((__m256i *)(states + 8 * v), x[v]);
    return write_layout(states, top, ptr, out, cap);
}

static uint32_t perm_lut[256][8]; /* movemask of the lanes that renormalise -> where each takes its word */
static int perm_ready = 0;

static void build_perm(void) {
    for (int m = 0; m < 256; m++) {
        int k = 0;
        for (int j = 0; j < 8; j++) perm_lut[m][j] = (m >> j) & 1 ? (uint32_t)k++ : 0;
    }
    perm_ready = 1;
}

/* slot -> symbol | freq << 8 | cum << 20, for every slot of the 12-bit range; -1 if freq is not normalised. */
static int fill_lut(const uint16_t *freq, uint32_t *lut) {
    uint32_t c = 0;
    for (int s = 0; s < 256; s++) {
        if (c + freq[s] > TOT) return -1;
        for (uint32_t k = 0; k < freq[s]; k++) lut[c + k] = (uint32_t)s | ((uint32_t)freq[s] << 8) | (c << 20);
        c += freq[s];
    }
    return c == TOT ? 0 : -1;
}

/* The first `count` word streams of an encode4 layout, into p (start) and e (end); -4 if their
 * lengths do not add up to len. */
static int open_streams(const uint8_t *stream, uint64_t len, int count, const uint16_t **p, const uint16_t **e) {
    const uint32_t *st = (const uint32_t *)stream;
    const uint16_t *o = (const uint16_t *)(stream + 144);
    for (int v = 0; v < count; v++) { p[v] = o; o += st[32 + v]; e[v] = o; }
    return (const uint8_t *)o == stream + len ? 0 : -4;
}

#define INLINE static inline __attribute__((always_inline))

/* One decode step of 8 lanes: their symbols (one per 32-bit lane), x advanced. */
INLINE __m256i step8(__m256i *x, const uint32_t *lut) {
    const __m256i mask12 = _mm256_set1_epi32(TOT - 1);
    __m256i slot = _mm256_and_si256(*x, mask12);
    __m256i e = _mm256_i32gather_epi32((const int *)lut, slot, 4);
    __m256i f = _mm256_and_si256(_mm256_srli_epi32(e, 8), mask12);
    *x = _mm256_sub_epi32(_mm256_add_epi32(_mm256_mullo_epi32(f, _mm256_srli_epi32(*x, SCALE)), slot),
                          _mm256_srli_epi32(e, 20));
    return _mm256_and_si256(e, _mm256_set1_epi32(0xff));
}

/* The lanes of x below LOW take the next words of *ptr, in lane order. */
INLINE __m256i renorm8(__m256i x, const uint16_t **ptr) {
    __m256i need = _mm256_cmpeq_epi32(_mm256_srli_epi32(x, 15), _mm256_setzero_si256());
    int m = _mm256_movemask_ps(_mm256_castsi256_ps(need));
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)*ptr));
    w = _mm256_permutevar8x32_epi32(w, _mm256_loadu_si256((const __m256i *)perm_lut[m]));
    *ptr += __builtin_popcount(m);
    return _mm256_blendv_epi8(x, _mm256_or_si256(_mm256_slli_epi32(x, 16), w), need);
}

/* One step of all 32 lanes: their 32 symbols as bytes in lane order. streams: 1 (every vector
 * reads p[0]) or 4 (vector v reads p[v]). */
INLINE __m256i step32(__m256i x[4], const uint16_t **p, int streams, const uint32_t *lut) {
    __m256i s[4];
    for (int v = 0; v < 4; v++) s[v] = step8(&x[v], lut);
    for (int v = 0; v < 4; v++) x[v] = renorm8(x[v], &p[streams == 1 ? 0 : v]);
    __m256i packed = _mm256_packus_epi16(_mm256_packus_epi32(s[0], s[1]), _mm256_packus_epi32(s[2], s[3]));
    return _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

/* Everything an AVX2 decode starts from: the table, the 32 states, the word streams. */
INLINE int open_avx2(const uint8_t *stream, uint64_t len, const uint16_t *freq, int streams, uint32_t *lut,
                     __m256i x[4], const uint16_t **p, const uint16_t **e) {
    if (!perm_ready) build_perm();
    if (fill_lut(freq, lut) != 0) return -1;
    for (int v = 0; v < 4; v++) x[v] = _mm256_loadu_si256((const __m256i *)(stream + 32 * v));
    return open_streams(stream, len, streams, p, e);
}

/* Variants A (streams 1: encode4 with group 32) and B (streams 4: one per 8-lane vector, group 8,
 * so the vectors' reads do not chain): n symbols (n % LANES == 0) into out. */
static int decode_avx2(const uint8_t *stream, uint64_t len, const uint16_t *freq, uint8_t *out, uint32_t n,
                       int streams) {
    uint32_t lut[TOT] __attribute__((aligned(64)));
    __m256i x[4];
    const uint16_t *p[4], *e[4];
    int rc = open_avx2(stream, len, freq, streams, lut, x, p, e);
    if (rc != 0) return rc;
    for (uint32_t i = 0; i < n; i += LANES) _mm256_storeu_si256((__m256i *)(out + i), step32(x, p, streams, lut));
    for (int v = 0; v < streams; v++)
        if (p[v] != e[v]) return -3;
    return 0;
}

int rans_decode1_avx2(const uint8_t *stream, uint64_t len, const uint16_t *freq, uint8_t *out, uint32_t n) {
    return decode_avx2(stream, len, freq, out, n, 1);
}

int rans_decode4_avx2(const uint8_t *stream, uint64_t len, const uint16_t *freq, uint8_t *out, uint32_t n) {
    return decode_avx2(stream, len, freq, out, n, 4);
}

#if defined(__AVX512F__) && defined(__AVX512VBMI2__)
/* Variant C: AVX-512, 2 x 16 lanes, one word stream per 16 lanes (encode4 with group 16), the
 * renorm words placed by expand-loads (AVX512-VBMI2). */
int rans_decode2_avx512(const uint8_t *stream, uint64_t len, const uint16_t *freq, uint8_t *out, uint32_t n) {
    uint32_t lut[TOT] __attribute__((aligned(64)));
    const uint16_t *p[2], *e[2];
    if (fill_lut(freq, lut) != 0) return -1;
    if (open_streams(stream, len, 2, p, e) != 0) return -4;
    __m512i x[2] = {_mm512_loadu_si512((const void *)stream), _mm512_loadu_si512((const void *)(stream + 64))};
    const __m512i mask12 = _mm512_set1_epi32(TOT - 1);
    for (uint32_t i = 0; i < n; i += LANES) {
        for (int v = 0; v < 2; v++) {
            __m512i slot = _mm512_and_si512(x[v], mask12);
            __m512i g = _mm512_i32gather_epi32(slot, (const void *)lut, 4);
            _mm_storeu_si128((__m128i *)(out + i + 16 * v), _mm512_cvtepi32_epi8(g));
            __m512i f = _mm512_and_si512(_mm512_srli_epi32(g, 8), mask12);
            x[v] = _mm512_sub_epi32(_mm512_add_epi32(_mm512_mullo_epi32(f, _mm512_srli_epi32(x[v], SCALE)), slot),
                                    _mm512_srli_epi32(g, 20));
        }
        for (int v = 0; v < 2; v++) {
            __mmask16 m = _mm512_cmplt_epu32_mask(x[v], _mm512_set1_epi32(LOW));
            __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_expandloadu_epi16(m, p[v]));
            x[v] = _mm512_mask_or_epi32(x[v], m, _mm512_slli_epi32(x[v], 16), w);
            p[v] += __builtin_popcount(m);
        }
    }
    return (p[0] == e[0] && p[1] == e[1]) ? 0 : -3;
}
#endif

/* Variant D: variant B fused with the rebuild of the bf16 words. Each step's 32 decoded pair bytes
 * are split into 64 codes, the exponent bytes (base + code) joined with the 64 stored low bytes and
 * rotated right by one bit into the 64 words; escape codes (15) take the next exception byte.
 * Returns 0, or < 0 when the stream or the exceptions do not fit. */
int rans_decode_words_avx2(const uint8_t *stream, uint64_t len, const uint16_t *freq, uint32_t n_pairs,
                           uint8_t base, const uint8_t *exc, uint32_t n_exc, const uint8_t *low, uint16_t *words) {
    uint32_t lut[TOT] __attribute__((aligned(64)));
    __m256i x[4];
    const uint16_t *p[4], *e[4];
    int rc = open_avx2(stream, len, freq, 4, lut, x, p, e);
    if (rc != 0) return rc;
    const __m256i nib = _mm256_set1_epi8(0x0f);
    const __m256i esc = _mm256_set1_epi8(15);
    const __m256i vbase = _mm256_set1_epi8((char)base);
    uint32_t ei = 0;
    for (uint32_t i = 0; i < n_pairs; i += LANES) {
        __m256i pk = step32(x, p, 4, lut);
        __m256i lo4 = _mm256_and_si256(pk, nib);
        __m256i hi4 = _mm256_and_si256(_mm256_srli_epi16(pk, 4), nib);
        __m256i ca = _mm256_unpacklo_epi8(lo4, hi4), cb = _mm256_unpackhi_epi8(lo4, hi4);
        __m256i codes0 = _mm256_permute2x128_si256(ca, cb, 0x20);  /* codes 0..31 */
        __m256i codes1 = _mm256_permute2x128_si256(ca, cb, 0x31);  /* codes 32..63 */
        uint32_t m0 = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(codes0, esc));
        uint32_t m1 = (uint32_t)_mm256_movemask_epi8(_mm256_cmpeq_epi8(codes1, esc));
        const uint8_t *lw = low + 2 * (uint64_t)i;
        uint16_t *dst = words + 2 * (uint64_t)i;
        __m256i h[2] = {_mm256_add_epi8(codes0, vbase), _mm256_add_epi8(codes1, vbase)};
        for (int half = 0; half < 2; half++) {
            __m256i l = _mm256_loadu_si256((const __m256i *)(lw + 32 * half));
            __m256i wa = _mm256_unpacklo_epi8(l, h[half]), wb = _mm256_unpackhi_epi8(l, h[half]);
            __m256i w0 = _mm256_permute2x128_si256(wa, wb, 0x20), w1 = _mm256_permute2x128_si256(wa, wb, 0x31);
            w0 = _mm256_or_si256(_mm256_srli_epi16(w0, 1), _mm256_slli_epi16(w0, 15));
            w1 = _mm256_or_si256(_mm256_srli_epi16(w1, 1), _mm256_slli_epi16(w1, 15));
            _mm256_storeu_si256((__m256i *)(dst + 32 * half), w0);
            _mm256_storeu_si256((__m256i *)(dst + 32 * half + 16), w1);
        }
        uint64_t escapes = (uint64_t)m0 | ((uint64_t)m1 << 32);
        while (escapes) {
            int k = __builtin_ctzll(escapes);
            escapes &= escapes - 1;
            if (ei >= n_exc) return -5;
            uint16_t w = (uint16_t)(((uint16_t)exc[ei++] << 8) | lw[k]);
            dst[k] = (uint16_t)((w >> 1) | (w << 15));
        }
    }
    for (int v = 0; v < 4; v++)
        if (p[v] != e[v]) return -3;
    return ei == n_exc ? 0 : -6;
}
