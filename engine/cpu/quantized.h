/* The GEMM over weights that stay quantized in memory: GGUF's Q8_0, Q4_0 and Q4_1 blocks (32
 * weights along k sharing an fp16 scale d, and for Q4_1 an fp16 minimum m), repacked into panels
 * of 16 output features. kernels.c includes this before the typed kernels, which call
 * `quant_gemm` for any weight whose format is not the model's float dtype.
 *
 * Arithmetic is llama.cpp's: each row's inputs are quantized per block of 32 to int8 with a scale
 * (dx = max |x| / 127, x = dx xq, rounded to nearest even), and a block's products are integer dot
 * products, exact, four at a time (AVX512-VNNI's vpdpbusd: unsigned bytes times signed bytes, 64
 * products an instruction; with AVX2, vpmaddubsw then vpmaddwd, 32 a pair; a plain C loop
 * computing the same integers elsewhere). A block adds
 *   Q8_0: d dx (sum (q + 128) xq - 128 sum xq)      (weights stored as the unsigned q + 128)
 *   Q4_0: d dx (sum q xq - 8 sum xq)
 *   Q4_1: d dx sum q xq + m sum x                    (sum x: the row's floats, in k order)
 *   Q4_K: as Q4_1, with an fp32 d and m (GGUF's Q4_K: a 256-weight super-block's fp16 d and dmin
 *         times each 32-weight block's 6-bit scale and minimum, products exact in fp32)
 * to the feature's fp32 sum, blocks in k order. Widening each weight to fp32 instead took as many
 * vector instructions a weight as reading bf16 does, and a few rows are compute-bound on a CPU
 * core: int8 dots do a block in a quarter of them. Everything a row's result depends on (its own
 * quantized inputs, exact integer sums, one fixed float epilogue) is its own, so batch invariance
 * holds, and the integers are the same on any CPU.
 *
 * A panel is K / 32 blocks in k order; a block holds, for its 16 features, 16 fp16 scales (Q4_1:
 * then 16 fp16 minimums; Q4_K: 16 fp32 scales, 16 fp32 minimums), then the codes in groups of four
 * consecutive k, a group's 16 features side by side (64 bytes, one vector: feature j's four bytes
 * in lane j):
 *   Q8_0: 8 groups (k = 4g .. 4g + 3) of q + 128                           (32 + 512 bytes)
 *   Q4:   4 groups of bytes q[4g + i] | q[16 + 4g + i] << 4, GGUF's own bytes (32, 64 or 128 + 256)
 * so packing moves whole bytes (Q8_0: flips their top bit) and the bytes a step reads are the
 * file's (Q4_K's codes are laid out as Q4_1's at load: 6 bits a weight in memory, not the file's 4.5,
 * so that its blocks run through the same kernel). */
enum { FORMAT_FLOAT = 0, FORMAT_Q8_0 = 1, FORMAT_Q4_0 = 2, FORMAT_Q4_1 = 3, FORMAT_Q4_K = 4 };
#define FORMAT_16_BIT_INPUTS 8 /* added to a format code: its inputs are quantized to 16 bits */
#define QBLOCK 32
#define QUANT_ROWS (VW == 16 ? 8 : 4) /* rows a panel kernel takes at once: their sums fill the registers */

static inline int64_t quant_head_bytes(int64_t format) {
  return format == FORMAT_Q4_K ? 128 : format == FORMAT_Q4_1 ? 64 : 32;
}
static inline int64_t quant_block_bytes(int64_t format) {
  return quant_head_bytes(format) + (format == FORMAT_Q8_0 ? QBLOCK * PANEL : QBLOCK / 2 * PANEL);
}

/* 16 fp16 values as NH vectors of floats. */
static inline void load16_half(const void *p, vn out[NH]) {
#ifdef __AVX512F__
  out[0] = (vn)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) && VW == 8
  for (int h = 0; h < 2; ++h) out[h] = (vn)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const char *)p + 16 * h)));
#elif defined(__FLT16_MAX__)
  typedef _Float16 v16h_ __attribute__((vector_size(32)));
  v16h_ h;
  memcpy(&h, p, sizeof(h));
  const v16 f = __builtin_convertvector(h, v16);
  memcpy(out, &f, sizeof(f));
#else /* IEEE half to float by its bits */
  float *lane = (float *)out;
  for (int i = 0; i < 16; ++i) {
    uint16_t h;
    memcpy(&h, (const char *)p + 2 * i, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 31, mantissa = h & 1023;
    float f;
    if (exponent == 0) f = mantissa * 5.9604644775390625e-8f; /* subnormal: mantissa x 2^-24 */
    else if (exponent == 31) f = mantissa ? __builtin_nanf("") : __builtin_inff();
    else {
      const uint32_t bits = ((exponent + 112) << 23) | (mantissa << 13);
      memcpy(&f, &bits, 4);
    }
    uint32_t u;
    memcpy(&u, &f, 4);
    u |= sign;
    memcpy(&f, &u, 4);
    lane[i] = f;
  }
#endif
}

static inline void load16_float(const void *p, vn out[NH]) { memcpy(out, p, 16 * sizeof(float)); }

/* 16 lanes of int32: lane j += the dot product of the four unsigned bytes of lane j of w with the
 * four signed bytes at x. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QUANT_DOTS 1 /* byte dot products by instruction (baton_quantized_dots) */
typedef __m512i v16d; /* 16 int32 sums */
typedef __m512i v64b; /* 64 bytes of codes */
static inline v16d dot4(v16d acc, v64b w, const int8_t *x) {
  int32_t four;
  memcpy(&four, x, 4);
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(four));
}
#define dot4_bytes dot4
static inline v16d zero16d(void) { return _mm512_setzero_si512(); }
static inline v16d add16d(v16d a, v16d b) { return _mm512_add_epi32(a, b); }
static inline v64b load64(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
static inline v64b low_nibbles(v64b v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
static inline v64b high_nibbles(v64b v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
static inline void ints_to_floats(v16d v, vn out[NH]) { out[0] = (vn)_mm512_cvtepi32_ps(v); }
static inline v16d minus_times(v16d v, int32_t a, int32_t b) { return _mm512_sub_epi32(v, _mm512_set1_epi32(a * b)); }
static inline v16d shift8(v16d v) { return _mm512_slli_epi32(v, 8); }
#elif defined(__AVX2__)
/* AVX2 without VNNI: vpmaddubsw (unsigned times signed bytes, pairs summed into int16, saturating)
 * then vpmaddwd (pairs into int32). No pair saturates for 4-bit codes (2 x 15 x 128); a Q8_0 byte
 * goes in as its two nibbles, 16 high + low. The same integers as VNNI's, so the same bits. */
#define QUANT_DOTS 1
typedef struct { __m256i h[2]; } v16d; /* lanes 0-7, 8-15 */
typedef struct { __m256i h[2]; } v64b; /* bytes 0-31, 32-63 */
static inline v64b low_nibbles(v64b v) {
  const __m256i fifteen = _mm256_set1_epi8(15);
  return (v64b){{_mm256_and_si256(v.h[0], fifteen), _mm256_and_si256(v.h[1], fifteen)}};
}
static inline v64b high_nibbles(v64b v) {
  const __m256i fifteen = _mm256_set1_epi8(15);
  return (v64b){{_mm256_and_si256(_mm256_srli_epi16(v.h[0], 4), fifteen),
                 _mm256_and_si256(_mm256_srli_epi16(v.h[1], 4), fifteen)}};
}
/* w's bytes (each at most 15) times x's four bytes, each pair of products summed and multiplied by
 * `times` into int32 */
static inline __m256i dot4_nibbles(__m256i w, const int8_t *x, int16_t times) {
  int32_t four;
  memcpy(&four, x, 4);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_set1_epi32(four)), _mm256_set1_epi16(times));
}
static inline v16d dot4(v16d acc, v64b w, const int8_t *x) { /* bytes of w at most 15 */
  for (int h = 0; h < 2; ++h) acc.h[h] = _mm256_add_epi32(acc.h[h], dot4_nibbles(w.h[h], x, 1));
  return acc;
}
static inline v16d dot4_bytes(v16d acc, v64b w, const int8_t *x) { /* any bytes of w: 16 high + low */
  const v64b high = high_nibbles(w), low = low_nibbles(w);
  for (int h = 0; h < 2; ++h)
    acc.h[h] = _mm256_add_epi32(acc.h[h], _mm256_add_epi32(dot4_nibbles(high.h[h], x, 16), dot4_nibbles(low.h[h], x, 1)));
  return acc;
}
static inline v16d zero16d(void) { return (v16d){{_mm256_setzero_si256(), _mm256_setzero_si256()}}; }
static inline v16d add16d(v16d a, v16d b) {
  return (v16d){{_mm256_add_epi32(a.h[0], b.h[0]), _mm256_add_epi32(a.h[1], b.h[1])}};
}
static inline v64b load64(const uint8_t *p) {
  return (v64b){{_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32))}};
}
static inline void ints_to_floats(v16d v, vn out[NH]) { /* (AVX-512 without VNNI comes here too) */
  for (int h = 0; h < 2; ++h) {
    const __m256 f = _mm256_cvtepi32_ps(v.h[h]);
    memcpy((float *)out + 8 * h, &f, sizeof(f));
  }
}
static inline v16d minus_times(v16d v, int32_t a, int32_t b) {
  const __m256i c = _mm256_set1_epi32(a * b);
  return (v16d){{_mm256_sub_epi32(v.h[0], c), _mm256_sub_epi32(v.h[1], c)}};
}
static inline v16d shift8(v16d v) { return (v16d){{_mm256_slli_epi32(v.h[0], 8), _mm256_slli_epi32(v.h[1], 8)}}; }
#elif defined(__ARM_FEATURE_DOTPROD) && defined(__ARM_NEON)
/* ARMv8.2's dot products (Graviton 2 onwards, Ampere Altra, Apple silicon): sdot takes signed bytes,
 * so codes go in as nibbles (at most 15: the same as signed), a Q8_0 byte as 16 high + low, as on
 * AVX2. Integer sums are exact, so the same integers as VNNI's and the same bits. */
#include <arm_neon.h>
#define QUANT_DOTS 1
typedef struct { int32x4_t h[4]; } v16d; /* lanes 4h .. 4h + 3 */
typedef struct { uint8x16_t h[4]; } v64b; /* bytes 16h .. 16h + 15 */
static inline v64b low_nibbles(v64b v) {
  for (int h = 0; h < 4; ++h) v.h[h] = vandq_u8(v.h[h], vdupq_n_u8(15));
  return v;
}
static inline v64b high_nibbles(v64b v) {
  for (int h = 0; h < 4; ++h) v.h[h] = vshrq_n_u8(v.h[h], 4);
  return v;
}
static inline int8x16_t four_bytes(const int8_t *x) { /* x's four bytes in every lane */
  int32_t four;
  memcpy(&four, x, 4);
  return vreinterpretq_s8_s32(vdupq_n_s32(four));
}
static inline v16d dot4(v16d acc, v64b w, const int8_t *x) { /* bytes of w at most 15 */
  const int8x16_t xs = four_bytes(x);
  for (int h = 0; h < 4; ++h) acc.h[h] = vdotq_s32(acc.h[h], vreinterpretq_s8_u8(w.h[h]), xs);
  return acc;
}
static inline v16d dot4_bytes(v16d acc, v64b w, const int8_t *x) { /* any bytes of w: 16 high + low */
  const int8x16_t xs = four_bytes(x);
  const v64b high = high_nibbles(w), low = low_nibbles(w);
  for (int h = 0; h < 4; ++h) {
    const int32x4_t up = vdotq_s32(vdupq_n_s32(0), vreinterpretq_s8_u8(high.h[h]), xs);
    acc.h[h] = vaddq_s32(vdotq_s32(acc.h[h], vreinterpretq_s8_u8(low.h[h]), xs), vshlq_n_s32(up, 4));
  }
  return acc;
}
static inline v16d zero16d(void) {
  v16d z;
  for (int h = 0; h < 4; ++h) z.h[h] = vdupq_n_s32(0);
  return z;
}
static inline v16d add16d(v16d a, v16d b) {
  for (int h = 0; h < 4; ++h) a.h[h] = vaddq_s32(a.h[h], b.h[h]);
  return a;
}
static inline v64b load64(const uint8_t *p) {
  v64b v;
  for (int h = 0; h < 4; ++h) v.h[h] = vld1q_u8(p + 16 * h);
  return v;
}
static inline void ints_to_floats(v16d v, vn out[NH]) {
  for (int h = 0; h < 4; ++h) {
    const float32x4_t f = vcvtq_f32_s32(v.h[h]);
    memcpy((float *)out + 4 * h, &f, sizeof(f));
  }
}
static inline v16d minus_times(v16d v, int32_t a, int32_t b) {
  for (int h = 0; h < 4; ++h) v.h[h] = vsubq_s32(v.h[h], vdupq_n_s32(a * b));
  return v;
}
static inline v16d shift8(v16d v) {
  for (int h = 0; h < 4; ++h) v.h[h] = vshlq_n_s32(v.h[h], 8);
  return v;
}
#else
#define QUANT_DOTS 0 /* the portable loop */
typedef v16i v16d;
typedef uint8_t v64b __attribute__((vector_size(64)));
static inline v16d dot4(v16d acc, v64b w, const int8_t *x) {
  for (int j = 0; j < 16; ++j)
    acc[j] += (int32_t)w[4 * j] * x[0] + (int32_t)w[4 * j + 1] * x[1] + (int32_t)w[4 * j + 2] * x[2] +
              (int32_t)w[4 * j + 3] * x[3];
  return acc;
}
#define dot4_bytes dot4
static inline v16d zero16d(void) { return (v16d){0}; }
static inline v16d add16d(v16d a, v16d b) { return a + b; }
static inline v64b load64(const uint8_t *p) {
  v64b v;
  memcpy(&v, p, 64);
  return v;
}
static inline v64b low_nibbles(v64b v) { return v & 15; }
static inline v64b high_nibbles(v64b v) { return v >> 4; }
static inline void ints_to_floats(v16d v, vn out[NH]) {
  const v16 f = __builtin_convertvector(v, v16);
  memcpy(out, &f, sizeof(f));
}
static inline v16d minus_times(v16d v, int32_t a, int32_t b) { return v - a * b; }
static inline v16d shift8(v16d v) { return v * 256; }
#endif

/* A row's inputs as quantize_inputs leaves them: per block of 32, int8 codes (or 16-bit codes as
 * their high and low bytes), the scale, the codes' sum and the floats' sum. */
struct quantized_rows {
  const int8_t *codes; /* [M][K] */
  const int8_t *low; /* [M][K] the low bytes of 16-bit codes (0: 8-bit codes) */
  const float *scale, *sum; /* [M][blocks] */
  const int32_t *code_sum; /* [M][blocks] */
  int64_t K, blocks;
};

/* One panel, M rows (rows m of `x`, starting at row0): out[m][col .. col + 16). One copy per
 * format, input precision and row count, so their constants fold away. With 8-bit inputs a row's
 * dots go to two chains (low and high nibbles, or even and odd groups: a dot product's latency is
 * 5 cycles); with 16-bit inputs, one chain for the codes' high bytes and one for their low bytes,
 * joined as 256 high + low: the integer sum over 16-bit codes, exactly. */
#define QUANT_PANEL_KERNEL(M, F, P)                                                                \
  static NOIPA void quant_panel_##F##_##P##_##M(const struct quantized_rows *xs, int64_t row0, const uint8_t *w, \
                                                float *out, int64_t N, int64_t col) {              \
    const struct quantized_rows x = *xs; /* by address: a struct passed by value stalled each call */ \
    const int64_t head = quant_head_bytes(F), bytes = quant_block_bytes(F);                        \
    const int32_t offset = F == FORMAT_Q8_0 ? 128 : F == FORMAT_Q4_0 ? 8 : 0;                      \
    vn acc[M][NH];                                                                                 \
    for (int m = 0; m < M; ++m)                                                                    \
      for (int h = 0; h < NH; ++h) acc[m][h] = (vn){0};                                            \
    for (int64_t b = 0; b < x.blocks; ++b) {                                                       \
      const uint8_t *block = w + b * bytes, *q = block + head;                                     \
      for (int64_t line = 0; line < bytes; line += 64)                                             \
        __builtin_prefetch((const char *)block + GEMM_PREFETCH_L2 + line, 0, 1);                   \
      v16d one[M], two[M];                                                                         \
      for (int m = 0; m < M; ++m) one[m] = two[m] = zero16d();                                     \
      const int8_t *xb = x.codes + row0 * x.K + b * QBLOCK, *lb = P ? x.low + row0 * x.K + b * QBLOCK : 0; \
      if (F == FORMAT_Q8_0) {                                                                      \
        for (int g = 0; g < 8; g += 2) {                                                           \
          const v64b w0 = load64(q + 64 * g), w1 = load64(q + 64 * (g + 1));                     \
          for (int m = 0; m < M; ++m) {                                                            \
            if (P) {                                                                               \
              one[m] = dot4_bytes(dot4_bytes(one[m], w0, xb + m * x.K + 4 * g), w1, xb + m * x.K + 4 * g + 4); \
              two[m] = dot4_bytes(dot4_bytes(two[m], w0, lb + m * x.K + 4 * g), w1, lb + m * x.K + 4 * g + 4); \
            } else {                                                                               \
              one[m] = dot4_bytes(one[m], w0, xb + m * x.K + 4 * g);                               \
              two[m] = dot4_bytes(two[m], w1, xb + m * x.K + 4 * g + 4);                           \
            }                                                                                      \
          }                                                                                        \
        }                                                                                          \
      } else {                                                                                     \
        for (int g = 0; g < 4; ++g) {                                                              \
          const v64b v = load64(q + 64 * g), lo = low_nibbles(v), hi = high_nibbles(v);            \
          for (int m = 0; m < M; ++m) {                                                            \
            if (P) {                                                                               \
              one[m] = dot4(dot4(one[m], lo, xb + m * x.K + 4 * g), hi, xb + m * x.K + 16 + 4 * g); \
              two[m] = dot4(dot4(two[m], lo, lb + m * x.K + 4 * g), hi, lb + m * x.K + 16 + 4 * g); \
            } else {                                                                               \
              one[m] = dot4(one[m], lo, xb + m * x.K + 4 * g);                                     \
              two[m] = dot4(two[m], hi, xb + m * x.K + 16 + 4 * g);                                \
            }                                                                                      \
          }                                                                                        \
        }                                                                                          \
      }                                                                                            \
      vn d[NH], mins[NH]; /* the features' scales and (Q4_1, Q4_K) minimums */                    \
      if (F == FORMAT_Q4_K) load16_float(block, d), load16_float(block + 64, mins);                \
      else load16_half(block, d);                                                                  \
      if (F == FORMAT_Q4_1) load16_half(block + 32, mins);                                         \
      for (int m = 0; m < M; ++m) {                                                                \
        const int64_t at = (row0 + m) * x.blocks + b;                                              \
        v16d sum = P ? add16d(shift8(one[m]), two[m]) : add16d(one[m], two[m]);                    \
        if (offset) sum = minus_times(sum, offset, x.code_sum[at]);                                \
        vn f[NH];                                                                                  \
        ints_to_floats(sum, f);                                                                    \
        for (int h = 0; h < NH; ++h) {                                                             \
          acc[m][h] = fmadd(f[h], d[h] * x.scale[at], acc[m][h]);                                  \
          if (F == FORMAT_Q4_1 || F == FORMAT_Q4_K) acc[m][h] = fmadd(mins[h], splat(x.sum[at]), acc[m][h]); \
        }                                                                                          \
      }                                                                                            \
    }                                                                                              \
    const int64_t width = N - col < PANEL ? N - col : PANEL;                                       \
    for (int m = 0; m < M; ++m) memcpy(out + m * N + col, &acc[m], width * sizeof(float));        \
  }
#define QUANT_PANEL_KERNELS(F, P)                                                                  \
  QUANT_PANEL_KERNEL(1, F, P) QUANT_PANEL_KERNEL(2, F, P) QUANT_PANEL_KERNEL(3, F, P)              \
  QUANT_PANEL_KERNEL(4, F, P) QUANT_PANEL_KERNEL(5, F, P) QUANT_PANEL_KERNEL(6, F, P)              \
  QUANT_PANEL_KERNEL(7, F, P) QUANT_PANEL_KERNEL(8, F, P)
QUANT_PANEL_KERNELS(1, 0) QUANT_PANEL_KERNELS(2, 0) QUANT_PANEL_KERNELS(3, 0) /* Q8_0, Q4_0, Q4_1; 8-bit */
QUANT_PANEL_KERNELS(4, 0)                                                       /* Q4_K */
QUANT_PANEL_KERNELS(1, 1) QUANT_PANEL_KERNELS(2, 1) QUANT_PANEL_KERNELS(3, 1) /* 16-bit inputs */
QUANT_PANEL_KERNELS(4, 1)
#undef QUANT_PANEL_KERNELS
#undef QUANT_PANEL_KERNEL

typedef void (*quant_panel_fn)(const struct quantized_rows *, int64_t, const uint8_t *, float *, int64_t, int64_t);
#define QUANT_ROW_COUNTS(F, P)                                                                     \
  {0, quant_panel_##F##_##P##_1, quant_panel_##F##_##P##_2, quant_panel_##F##_##P##_3, quant_panel_##F##_##P##_4, \
   quant_panel_##F##_##P##_5, quant_panel_##F##_##P##_6, quant_panel_##F##_##P##_7, quant_panel_##F##_##P##_8}
static const quant_panel_fn QUANT_PANELS[2][5][9] = {
    {{0}, QUANT_ROW_COUNTS(1, 0), QUANT_ROW_COUNTS(2, 0), QUANT_ROW_COUNTS(3, 0), QUANT_ROW_COUNTS(4, 0)},
    {{0}, QUANT_ROW_COUNTS(1, 1), QUANT_ROW_COUNTS(2, 1), QUANT_ROW_COUNTS(3, 1), QUANT_ROW_COUNTS(4, 1)}};
#undef QUANT_ROW_COUNTS

/* Row r of x [M, K] per block of 32, with dx = max |x| / 127: 8-bit codes round(x / dx) (to
 * nearest even; 0 for a block of zeros), scale dx; or (low given) 16-bit codes X = round(256 x /
 * dx), |X| <= 32512, as a high byte floor((X + 128) / 256) and a low byte X - 256 high (in -128..
 * 127), scale dx / 256. Also the codes' sum and the floats' sum: hsum16 of the block's two halves
 * added lane by lane. Sixteen values at a time (it was a twelfth of a decode step one by one). */
static void quantize_inputs(const float *x, int64_t M, int64_t K, int8_t *codes, int8_t *low, float *scale,
                            int32_t *code_sum, float *sum) {
  const int64_t blocks = K / QBLOCK;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = r * K + b * QBLOCK;
      v16 half[2];
      memcpy(half, x + at, sizeof(half));
      const v16i a0 = (v16i)half[0] & 0x7fffffff, a1 = (v16i)half[1] & 0x7fffffff; /* |x|: no sign bit */
      const v16i above = (v16)a0 > (v16)a1;
      const v16 tops = (v16)((a0 & above) | (a1 & ~above));
      float top = 0.f;
      for (int i = 0; i < 16; ++i) top = tops[i] > top ? tops[i] : top;
      const float dx = top / 127.f, inverse = dx > 0.f ? (low ? 256.f : 1.f) / dx : 0.f;
      int32_t codes_total = 0;
      for (int h = 0; h < 2; ++h) {
#ifdef __AVX512F__
        const v16i c = (v16i)_mm512_cvtps_epi32((__m512)(half[h] * inverse)); /* nearest even */
#else
        v16i c;
        for (int i = 0; i < 16; ++i) c[i] = (int32_t)__builtin_rintf(half[h][i] * inverse);
#endif
        const v16i high = (c + 128) >> 8; /* arithmetic: floor */
        const v16i own = low ? high : c, rest = c - 256 * high;
#ifdef __AVX512F__
        _mm_storeu_si128((__m128i *)(codes + at + 16 * h), _mm512_cvtepi32_epi8((__m512i)own));
        if (low) _mm_storeu_si128((__m128i *)(low + at + 16 * h), _mm512_cvtepi32_epi8((__m512i)rest));
        codes_total += _mm512_reduce_add_epi32((__m512i)c);
#else
        for (int i = 0; i < 16; ++i) {
          codes[at + 16 * h + i] = (int8_t)own[i];
          if (low) low[at + 16 * h + i] = (int8_t)rest[i];
          codes_total += c[i];
        }
#endif
      }
      scale[r * blocks + b] = low ? dx / 256.f : dx, code_sum[r * blocks + b] = codes_total;
      sum[r * blocks + b] = hsum16(half[0] + half[1]);
    }
}

/* y = x @ W^T for quantized panels. x: [M, K] fp32 (K a multiple of 32), quantized to 16-bit codes
 * when `precise`, else to 8-bit ones; out: [M, N]. Returns -1 when out of memory, else 0. */
static int quant_gemm(int64_t format, int precise, const float *x, const uint8_t *packed, float *out, int64_t M,
                      int64_t K, int64_t N, int threads) {
  const int64_t blocks = K / QBLOCK, panel_bytes = blocks * quant_block_bytes(format);
  const int64_t rows = M > 0 ? M : 1, cells = rows * (blocks > 0 ? blocks : 1);
  int8_t *codes = malloc(2 * rows * K + 64);
  float *floats = malloc(sizeof(float) * 2 * cells);
  int32_t *code_sum = malloc(sizeof(int32_t) * cells);
  if (!codes || !floats || !code_sum) {
    free(codes), free(floats), free(code_sum);
    return -1;
  }
  int8_t *low = precise ? codes + rows * K : 0;
  quantize_inputs(x, M, K, codes, low, floats, code_sum, floats + cells);
  const struct quantized_rows xq = {codes, low, floats, floats + cells, code_sum, K, blocks};
  const int64_t panels = (N + PANEL - 1) / PANEL;
  const quant_panel_fn *kernels = QUANT_PANELS[precise != 0][format];
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t m0 = 0; m0 < M; m0 += QUANT_ROWS)
      kernels[M - m0 < QUANT_ROWS ? M - m0 : QUANT_ROWS](&xq, m0, packed + p * panel_bytes, out + m0 * N, N, p * PANEL);
  free(codes), free(floats), free(code_sum);
  return 0;
}

int baton_quant_gemm(int64_t format, int64_t precise, const float *x, const uint8_t *packed, float *out, int64_t M,
                     int64_t K, int64_t N, int threads) {
  if (format < FORMAT_Q8_0 || format > FORMAT_Q4_K || K % QBLOCK) return -2;
  return quant_gemm(format, precise != 0, x, packed, out, M, K, N, threads);
}
