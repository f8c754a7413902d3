/* The GEMM over weights that stay quantized in memory: GGUF's Q8_0, Q4_0 and Q4_1 blocks (32
 * weights along k sharing an fp16 scale, and for Q4_1 an fp16 minimum), repacked into panels of
 * 16 output features as the float GEMM reads them. kernels.c includes this before the typed
 * kernels, which call `quant_gemm` for any weight whose format is not the model's float dtype.
 *
 * A panel is K / 32 blocks in k order; a block holds, for its 16 features:
 *   Q8_0: 16 fp16 scales d, then 32 k-rows of 16 int8 q         (544 bytes: w = d q)
 *   Q4_0: 16 fp16 scales d, then 16 rows of 16 bytes            (288 bytes: w = d (q - 8))
 *   Q4_1: 16 fp16 scales d, 16 fp16 minimums m, then 16 rows     (320 bytes: w = d q + m)
 * where byte t of a feature holds q[t] in its low nibble and q[t + 16] in its high one: GGUF's own
 * byte order, so packing transposes whole bytes and never reorders a nibble. The bytes a step
 * reads are the file's.
 *
 * Arithmetic is fp32: q is widened to a float in registers, a row's products over a block are
 * summed in a fixed order (two interleaved chains, below) and scaled once per block, and blocks are
 * added in order: sum_b d_b * sum_k x_k q_k (+ m_b * sum_k x_k, the row's block sum, computed once
 * per call in k order). Each row is reduced on its own, in an order fixed by the weights' format
 * alone: batch invariance holds as for float weights. */
enum { FORMAT_FLOAT = 0, FORMAT_Q8_0 = 1, FORMAT_Q4_0 = 2, FORMAT_Q4_1 = 3 };
#define QBLOCK 32

static inline int64_t quant_block_bytes(int64_t format) {
  return format == FORMAT_Q8_0 ? 32 + QBLOCK * PANEL : format == FORMAT_Q4_0 ? 32 + 16 * PANEL : 64 + 16 * PANEL;
}

static inline v16 load16_half(const void *p) {
#ifdef __AVX512F__
  return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__FLT16_MAX__)
  typedef _Float16 v16h_ __attribute__((vector_size(32)));
  v16h_ h;
  memcpy(&h, p, sizeof(h));
  return __builtin_convertvector(h, v16);
#else /* IEEE half to float by its bits */
  v16 out;
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
    out[i] = f;
  }
  return out;
#endif
}

static inline v16 load16_i8(const int8_t *p) {
#ifdef __AVX512F__
  return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
  typedef int8_t v16b_ __attribute__((vector_size(16)));
  v16b_ b;
  memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, v16);
#endif
}

/* 16 bytes -> their low nibbles and their high nibbles as floats */
static inline void load16_nibbles(const uint8_t *p, v16 *lo, v16 *hi) {
#ifdef __AVX512F__
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
  *lo = (v16)_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
  *hi = (v16)_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
#else
  typedef uint8_t v16ub_ __attribute__((vector_size(16)));
  v16ub_ b;
  memcpy(&b, p, sizeof(b));
  *lo = __builtin_convertvector(b & 15, v16);
  *hi = __builtin_convertvector(b >> 4, v16);
#endif
}

/* One panel, M rows: xt holds the rows' inputs k-major (M floats a k), xs their block sums
 * (M floats a block, Q4 only). A row's products over a block go to two accumulators (Q8_0: even
 * and odd k; Q4: the low and the high nibbles), added at the block's end: with one, a few rows
 * waited on each multiply-add's latency. */
#define QUANT_PANEL_KERNEL(M)                                                                      \
  static NOIPA void q8_panel_##M(const float *xt, const float *xs, int64_t rows, const uint8_t *w, \
                                 int64_t K, float *out, int64_t N, int64_t col) {                  \
    (void)xs;                                                                                      \
    v16 acc[M];                                                                                    \
    for (int m = 0; m < M; ++m) acc[m] = (v16){0};                                                 \
    for (int64_t b = 0; b < K / QBLOCK; ++b) {                                                     \
      const uint8_t *block = w + b * (32 + QBLOCK * PANEL);                                        \
      const int8_t *q = (const int8_t *)(block + 32);                                              \
      v16 even[M], odd[M]; /* two chains a row: one chain's FMA latency bound a few rows */        \
      for (int m = 0; m < M; ++m) even[m] = odd[m] = (v16){0};                                     \
      for (int64_t k = 0; k < QBLOCK; k += 2) {                                                    \
        if (k % 4 == 0) {                                                                          \
          __builtin_prefetch((const char *)(q + k * PANEL) + GEMM_PREFETCH_L2, 0, 1);              \
          __builtin_prefetch((const char *)(q + k * PANEL) + GEMM_PREFETCH_L1);                    \
        }                                                                                          \
        const v16 w0 = load16_i8(q + k * PANEL), w1 = load16_i8(q + (k + 1) * PANEL);              \
        const float *xk = xt + (b * QBLOCK + k) * rows, *xn = xk + rows;                           \
        for (int m = 0; m < M; ++m) {                                                              \
          even[m] += xk[m] * w0;                                                                   \
          odd[m] += xn[m] * w1;                                                                    \
        }                                                                                          \
      }                                                                                            \
      const v16 d = load16_half(block);                                                            \
      for (int m = 0; m < M; ++m) acc[m] += (even[m] + odd[m]) * d;                                \
    }                                                                                              \
    const int64_t width = N - col < PANEL ? N - col : PANEL;                                       \
    for (int m = 0; m < M; ++m) memcpy(out + m * N + col, &acc[m], width * sizeof(float));        \
  }                                                                                                \
  static NOIPA void q4_panel_##M(const float *xt, const float *xs, int64_t rows, const uint8_t *w, \
                                 int64_t K, float *out, int64_t N, int64_t col, int with_min) {    \
    const int64_t bytes = with_min ? 64 + 16 * PANEL : 32 + 16 * PANEL;                            \
    v16 acc[M];                                                                                    \
    for (int m = 0; m < M; ++m) acc[m] = (v16){0};                                                 \
    for (int64_t b = 0; b < K / QBLOCK; ++b) {                                                     \
      const uint8_t *block = w + b * bytes, *q = block + (with_min ? 64 : 32);                     \
      __builtin_prefetch((const char *)block + GEMM_PREFETCH_L2, 0, 1);                            \
      __builtin_prefetch((const char *)block + GEMM_PREFETCH_L2 + 64, 0, 1);                       \
      __builtin_prefetch((const char *)block + GEMM_PREFETCH_L2 + 128, 0, 1);                      \
      __builtin_prefetch((const char *)block + GEMM_PREFETCH_L2 + 192, 0, 1);                      \
      __builtin_prefetch((const char *)block + GEMM_PREFETCH_L2 + 256, 0, 1);                      \
      v16 low[M], high[M]; /* k < 16 and k >= 16: two chains a row */                              \
      for (int m = 0; m < M; ++m) low[m] = high[m] = (v16){0};                                     \
      for (int64_t t = 0; t < 16; ++t) {                                                           \
        v16 lo, hi;                                                                                \
        load16_nibbles(q + t * PANEL, &lo, &hi);                                                   \
        const float *xk = xt + (b * QBLOCK + t) * rows, *xh = xk + 16 * rows;                      \
        for (int m = 0; m < M; ++m) {                                                              \
          low[m] += xk[m] * lo;                                                                    \
          high[m] += xh[m] * hi;                                                                   \
        }                                                                                          \
      }                                                                                            \
      const v16 d = load16_half(block);                                                            \
      const v16 mins = with_min ? load16_half(block + 32) : d * -8.0f;                             \
      const float *sums = xs + b * rows;                                                           \
      for (int m = 0; m < M; ++m) {                                                                \
        acc[m] += (low[m] + high[m]) * d;                                                          \
        acc[m] += sums[m] * mins;                                                                  \
      }                                                                                            \
    }                                                                                              \
    const int64_t width = N - col < PANEL ? N - col : PANEL;                                       \
    for (int m = 0; m < M; ++m) memcpy(out + m * N + col, &acc[m], width * sizeof(float));        \
  }

QUANT_PANEL_KERNEL(1)
QUANT_PANEL_KERNEL(2)
QUANT_PANEL_KERNEL(3)
QUANT_PANEL_KERNEL(4)
QUANT_PANEL_KERNEL(5)
QUANT_PANEL_KERNEL(6)
QUANT_PANEL_KERNEL(7)
QUANT_PANEL_KERNEL(8)
#undef QUANT_PANEL_KERNEL

typedef void (*q8_panel_fn)(const float *, const float *, int64_t, const uint8_t *, int64_t, float *, int64_t, int64_t);
typedef void (*q4_panel_fn)(const float *, const float *, int64_t, const uint8_t *, int64_t, float *, int64_t, int64_t,
                            int);
static const q8_panel_fn Q8_PANELS[9] = {0, q8_panel_1, q8_panel_2, q8_panel_3, q8_panel_4,
                                         q8_panel_5, q8_panel_6, q8_panel_7, q8_panel_8};
static const q4_panel_fn Q4_PANELS[9] = {0, q4_panel_1, q4_panel_2, q4_panel_3, q4_panel_4,
                                         q4_panel_5, q4_panel_6, q4_panel_7, q4_panel_8};

/* y = x @ W^T for quantized panels. x: [M, K] fp32 (K a multiple of 32); out: [M, N]; xt: M * K
 * floats of scratch. Returns -1 when out of memory (the block sums), else 0. */
static int quant_gemm(int64_t format, const float *x, const uint8_t *packed, float *out, int64_t M, int64_t K,
                      int64_t N, int threads, float *xt) {
  const int64_t blocks = K / QBLOCK, panel_bytes = blocks * quant_block_bytes(format);
  float *xs = 0;
  if (format != FORMAT_Q8_0) {
    xs = malloc(sizeof(float) * (M > 0 ? M : 1) * (blocks > 0 ? blocks : 1));
    if (!xs) return -1;
  }
  for (int64_t m0 = 0; m0 < M; m0 += 8) { /* transposed as the float GEMM does; block sums in k order */
    const int64_t rows = M - m0 < 8 ? M - m0 : 8;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t m = 0; m < rows; ++m) xt[m0 * K + k * rows + m] = x[(m0 + m) * K + k];
    if (xs)
      for (int64_t b = 0; b < blocks; ++b)
        for (int64_t m = 0; m < rows; ++m) {
          float s = 0.f;
          for (int64_t k = 0; k < QBLOCK; ++k) s += x[(m0 + m) * K + b * QBLOCK + k];
          xs[m0 * blocks + b * rows + m] = s;
        }
  }
  const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      const int64_t rows = M - m0 < 8 ? M - m0 : 8;
      const uint8_t *w = packed + p * panel_bytes;
      if (format == FORMAT_Q8_0)
        Q8_PANELS[rows](xt + m0 * K, 0, rows, w, K, out + m0 * N, N, p * PANEL);
      else
        Q4_PANELS[rows](xt + m0 * K, xs + m0 * blocks, rows, w, K, out + m0 * N, N, p * PANEL,
                        format == FORMAT_Q4_1);
    }
  free(xs);
  return 0;
}

int baton_quant_gemm(int64_t format, const float *x, const uint8_t *packed, float *out, int64_t M, int64_t K,
                     int64_t N, int threads) {
  if (format < FORMAT_Q8_0 || format > FORMAT_Q4_1 || K % QBLOCK) return -2;
  float *xt = malloc(sizeof(float) * (M > 0 ? M : 1) * K);
  if (!xt) return -1;
  const int failed = quant_gemm(format, x, packed, out, M, K, N, threads, xt);
  free(xt);
  return failed;
}
