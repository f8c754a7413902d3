/* Baton's CPU kernels for the decode step, and for prefill wherever it must compute exactly as
 * decode does.
 *
 * Weights and KV are stored in fp32, bf16 or fp16 (the model's dtype); every sum, norm and
 * softmax runs in fp32 on fp32 activations. Each storage type gets its own copy of the typed
 * kernels (kernels_typed.h, included once per type below); bf16 and fp16 values are widened to
 * fp32 in registers as they are read, so a step reads half the bytes of fp32 and computes as fp32
 * does.
 *
 * Batch invariance: every kernel here reduces each row on its own, in an order fixed by that
 * row's data alone (the GEMM over k in order, attention over the row's tokens in order whatever
 * pages or segments hold them, norms over the row's features). A row's result is therefore the
 * same bits whatever other rows share its call, and prefill computes each token exactly as a
 * decode step would. The shared cores are `noipa`: one compiled copy serves every caller, so no
 * caller gets a differently contracted or vectorised copy.
 *
 * The weight is packed in panels of 16 output features, k-major: packed[p][k][j] = W[16p + j][k]
 * (zero-padded past N), so one panel is a contiguous stream that a core reads front to back
 * while up to GEMM_ROWS rows accumulate in vector registers, 16 floats per row: one weight load
 * and one broadcast of x feed 16 multiply-adds, and the 4-cycle chain of each accumulator covers
 * a whole vector of weights, so a few rows stream them at memory speed. Further rows are taken
 * GEMM_ROWS at a time while the panel is still in cache. Panels are split between `threads`
 * OpenMP threads (torch's own runtime: libgomp is resolved by soname; the caller passes torch's
 * thread count, since the calling thread's own OpenMP setting may not be torch's).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__FMA__)
#include <immintrin.h>
#endif

#define NOIPA __attribute__((noipa))
#define CAT_(a, b) a##_##b
#define CAT(a, b) CAT_(a, b)
#define PANEL 16
typedef float v4 __attribute__((vector_size(16)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
/* The machine's own vector: 16 floats with AVX-512, 8 with AVX, else 4 (SSE, NEON). The kernels'
 * 16-lane vectors are held as NH of these: each lane computes the same operations and each sum of
 * 16 lanes adds in hsum16's order, so every CPU with FMA computes the same bits; only the registers
 * differ. (Written with 64-byte vectors alone, GCC kept them in memory on CPUs without AVX-512:
 * an AVX2 build ran its GEMM at a tenth of this core's AVX-512 rate.) */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#define NH (16 / VW)
typedef float vn __attribute__((vector_size(4 * VW)));
typedef int32_t vni __attribute__((vector_size(4 * VW)));
typedef uint32_t vnu __attribute__((vector_size(4 * VW)));
typedef uint16_t vns __attribute__((vector_size(2 * VW)));
/* Software prefetch, in bytes of a panel ahead: hardware prefetchers stop at page ends. Far ahead
 * into L2 keeps enough lines in flight; near ahead into L1 keeps the demand loads hitting. Into L1
 * alone from far ahead, the stream evicted the transposed input the broadcasts read, and 8 rows
 * streamed at 16 GB/s instead of 23. */
#define GEMM_PREFETCH_L2 24576
#define GEMM_PREFETCH_L1 4096
/* Rows a panel kernel takes at once: their accumulators (16 floats each) and a panel's 16 weights
 * fill the registers (32 with AVX-512, 16 otherwise). */
#define GEMM_ROWS (VW == 16 ? 8 : VW == 8 ? 6 : 3)

/* The sum of 16 lanes: lanes i and i + 8, then i and i + 4, then (0 + 2) + (1 + 3). Every kernel
 * sums a vector this way, and with AVX-512 the halves come from register extracts (the generic
 * form went through the stack and stalled on store forwarding): the same additions either way. */
static inline float hsum16(v16 x) {
#ifdef __AVX512F__
  const __m512 z = (__m512)x;
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(z), _mm512_extractf32x8_ps(z, 1));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4)); /* s4[0] + s4[2], s4[1] + s4[3] */
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
#else
  v8 lo, hi;
  memcpy(&lo, &x, sizeof(v8));
  memcpy(&hi, (const char *)&x + sizeof(v8), sizeof(v8));
  v8 s8 = lo + hi;
  v4 a, b;
  memcpy(&a, &s8, sizeof(v4));
  memcpy(&b, (const char *)&s8 + sizeof(v4), sizeof(v4));
  v4 s4 = a + b;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#endif
}

/* hsum16 of 16 lanes held as NH native vectors (lanes h * VW onwards in p[h]): the same additions. */
static inline float hsum16n(const vn *p) {
#if VW == 16
  return hsum16(p[0]);
#elif VW == 8
  const __m256 s8 = (__m256)(p[0] + p[1]);
  const v4 s4 = (v4)_mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#else
  const v4 s4 = (p[0] + p[2]) + (p[1] + p[3]); /* lanes i + i+8, then i + i+4 */
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#endif
}

#ifdef __AVX512F__
/* hsum16 of 16 vectors at once, with the very same additions per vector, into out[0..count) times
 * scale: x[SLOT16(i)] holds vector i. Pairs of vectors share each add (halves, then quarters, then
 * the last two steps within 128-bit lanes), a quarter of the shuffles and adds of 16 hsum16s. */
#define SLOT16(i) ((((i) & 3) << 2) | ((i) >> 2)) /* the transpose that leaves the sums in order */
static inline void hsum16x16(const v16 *x, float scale, float *out, int64_t count) {
  __m512 y[8], z[4];
  for (int i = 0; i < 8; ++i) {
    const __m512 a = (__m512)x[2 * i], b = (__m512)x[2 * i + 1];
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xee)); /* lanes i + i+8 */
  }
  for (int i = 0; i < 4; ++i) /* lanes i + i+4 of each vector's eight */
    z[i] = _mm512_add_ps(_mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(y[2 * i], y[2 * i + 1], 0xdd));
  const __m512 t0 = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], 0x44), _mm512_shuffle_ps(z[0], z[1], 0xee));
  const __m512 t1 = _mm512_add_ps(_mm512_shuffle_ps(z[2], z[3], 0x44), _mm512_shuffle_ps(z[2], z[3], 0xee));
  /* (s4[0] + s4[2]) + (s4[1] + s4[3]) */
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, 0x88), _mm512_shuffle_ps(t0, t1, 0xdd));
  const v16 scaled = (v16)r * scale;
  memcpy(out, &scaled, sizeof(float) * count);
}
#endif

/* v > top ? v : top in each lane (top where v is NaN): one vmaxps with AVX-512. */
static inline vn vmax(vn v, vn top) {
#ifdef __AVX512F__
  return (vn)_mm512_max_ps((__m512)v, (__m512)top);
#else
  const vni above = v > top;
  return (vn)(((vni)v & above) | ((vni)top & ~above));
#endif
}

/* e^x for each lane, x <= 88 (scores minus their maximum, SiLU's capped arguments): 2^n e^r with
 * |r| <= ln2 / 2 and Cephes' degree-6 polynomial for e^r, within 2 ulp of expf; below -87.3 it
 * gives ~1e-38, not 0. */
static inline vn expn(vn x) {
  const vn lo = {0}, floor_x = lo - 87.3f;
  x = vmax(floor_x, x); /* floor_x where x is below it */
  const vn magic = lo + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer, kept in the low bits */
  vn t = x * 1.44269504088896341f + magic;
  t -= magic; /* n, an integer */
  vn r = x - t * 0.693359375f;
  r = r - t * -2.12194440e-4f;
  vn p = lo + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
#ifdef __AVX512F__
  return (vn)_mm512_scalef_ps((__m512)p, (__m512)t); /* p 2^n: one instruction, the same product */
#else
  return p * (vn)((__builtin_convertvector(t, vni) + 127) << 23); /* 2^n built from its exponent bits */
#endif
}

/* Softmax of one head's scores in place (probabilities), returns its log-sum-exp. Softmax in fp32
 * with the running maximum subtracted, as SDPA does, its exponentials 16 lanes at a time (a scalar
 * expf per score was a third of attention's time). The maximum is taken 16 lanes at a time too (a
 * scalar chain of compares was three quarters of the softmax): a maximum is the same whatever the
 * order, but for its sign when it is zero, and x - 0 and x + 0 are equal for every x but -0, whose
 * exponential is 1 either way. */
static NOIPA float softmax(float *s, int64_t n) {
  vn tops = (vn){0} - __builtin_inff();
  int64_t t = 0;
  for (; t + VW <= n; t += VW) {
    vn x;
    memcpy(&x, s + t, sizeof(vn));
    tops = vmax(x, tops); /* never NaN: a NaN score compares false, as below */
  }
  float top = -__builtin_inff();
  for (int i = 0; i < VW; ++i) top = tops[i] > top ? tops[i] : top;
  for (; t < n; ++t) top = s[t] > top ? s[t] : top;
  vn sum[NH] = {{0}}; /* lane l: the tokens t = l mod 16 */
  t = 0;
  for (; t + 16 <= n; t += 16)
    for (int h = 0; h < NH; ++h) {
      vn x;
      memcpy(&x, s + t + h * VW, sizeof(vn));
      x = expn(x - top);
      memcpy(s + t + h * VW, &x, sizeof(vn));
      sum[h] += x;
    }
  if (t < n) { /* the last few: lanes past the end count as nothing */
    float x[16] = {0};
    memcpy(x, s + t, sizeof(float) * (n - t));
    for (int h = 0; h < NH; ++h) {
      vn e;
      memcpy(&e, x + h * VW, sizeof(vn));
      e = expn(e - top);
      memcpy(x + h * VW, &e, sizeof(vn));
    }
    for (int64_t i = 0; i < n - t; ++i) sum[i / VW][i % VW] += x[i];
    memcpy(s + t, x, sizeof(float) * (n - t));
  }
  const float total = hsum16n(sum);
  const float inv = 1.0f / total;
  for (t = 0; t < n; ++t) s[t] *= inv;
  return top + __builtin_logf(total);
}

/* Every lane x. */
static inline vn splat(float x) {
#if VW == 16
  const vn v = {x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
#elif VW == 8
  const vn v = {x, x, x, x, x, x, x, x};
#else
  const vn v = {x, x, x, x};
#endif
  return v;
}

/* a * b + c rounded once: attention's scores are chains of these, decode's and prefill's alike.
 * Written out, not left to contraction: of `x * y + z * w` a compiler may fuse either product, and
 * decode's and prefill's differently shaped code must fuse the same one. */
static inline vn fmadd(vn a, vn b, vn c) {
#if defined(__AVX512F__)
  return (vn)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
  return (vn)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(__FP_FAST_FMAF)
  vn out;
  for (int i = 0; i < VW; ++i) out[i] = __builtin_fmaf(a[i], b[i], c[i]);
  return out;
#else
  return a * b + c; /* no multiply-add instruction: a product, then a sum, wherever it is written */
#endif
}

/* Prefill's scores: G query heads of a tile's rows (qt, [G][D] vectors, lane i = row i's query)
 * against T tokens (k, [T][D] fp32): s[t * stride + g], lane i = row i's score of token t, summed
 * as group_attention sums it for that row alone: there lane l of a vector of products holds the
 * chain q[l] k[l], + q[16 + l] k[16 + l], ..., and the 16 lanes add up in hsum16's
 * order; here each lane's chain is a vector of the tile's rows and the adds between lanes are
 * plain vector adds, so no key is transposed and no sum shuffled. hsum16's order pairs lanes l
 * and l + 8 (s8[l]), then s8[m] and s8[m + 4] (s4[m]); the chains of a pair run together. */
#define TILE_QK(NV, G, T)                                                                           \
  static inline void tile_qk_lanes_##NV##_##G##_##T(const vn *qt, const float *k, int64_t l, vn out[G][T]) { \
    const int64_t D = NV * 16; /* out: the chains of lanes l and l + 8, added (s8[l]) */            \
    vn a[G][T], b[G][T];                                                                            \
    for (int t = 0; t < T; ++t) {                                                                   \
      const vn ka = splat(k[t * D + l]), kb = splat(k[t * D + l + 8]);                              \
      for (int g = 0; g < G; ++g) a[g][t] = qt[g * D + l] * ka, b[g][t] = qt[g * D + l + 8] * kb;   \
    }                                                                                               \
    for (int64_t j = 16; j < D; j += 16)                                                            \
      for (int t = 0; t < T; ++t) {                                                                 \
        const vn ka = splat(k[t * D + j + l]), kb = splat(k[t * D + j + l + 8]);                    \
        for (int g = 0; g < G; ++g) {                                                               \
          a[g][t] = fmadd(qt[g * D + j + l], ka, a[g][t]);                                          \
          b[g][t] = fmadd(qt[g * D + j + l + 8], kb, b[g][t]);                                      \
        }                                                                                           \
      }                                                                                             \
    for (int g = 0; g < G; ++g)                                                                     \
      for (int t = 0; t < T; ++t) out[g][t] = a[g][t] + b[g][t];                                    \
  }                                                                                                 \
  static inline void tile_qk_##NV##_##G##_##T(const vn *qt, const float *k, float scale, vn *s, int64_t stride) { \
    vn s4[4][G][T], upper[G][T]; /* s4[m] = s8[m] + s8[m + 4] */                                    \
    for (int m = 0; m < 4; ++m) {                                                                   \
      tile_qk_lanes_##NV##_##G##_##T(qt, k, m, s4[m]);                                              \
      tile_qk_lanes_##NV##_##G##_##T(qt, k, m + 4, upper);                                          \
      for (int g = 0; g < G; ++g)                                                                   \
        for (int t = 0; t < T; ++t) s4[m][g][t] += upper[g][t];                                     \
    }                                                                                               \
    for (int g = 0; g < G; ++g)                                                                     \
      for (int t = 0; t < T; ++t)                                                                   \
        s[t * stride + g] = ((s4[0][g][t] + s4[2][g][t]) + (s4[1][g][t] + s4[3][g][t])) * scale;    \
  }
/* A block of `count` tokens, T at a time (G x T x 4 chains in flight), then one at a time. */
#define TILE_QK_BLOCK(NV, G, T)                                                                     \
  TILE_QK(NV, G, 1)                                                                                 \
  TILE_QK(NV, G, T)                                                                                 \
  static void tile_qk_##NV##_##G(const vn *qt, const float *k, int64_t count, float scale, vn *s, int64_t stride) { \
    int64_t t = 0;                                                                                  \
    for (; t + T <= count; t += T) tile_qk_##NV##_##G##_##T(qt, k + t * NV * 16, scale, s + t * stride, stride); \
    for (; t < count; ++t) tile_qk_##NV##_##G##_1(qt, k + t * NV * 16, scale, s + t * stride, stride); \
  }
TILE_QK_BLOCK(4, 1, 4) TILE_QK_BLOCK(4, 2, 3) TILE_QK_BLOCK(4, 3, 2) TILE_QK_BLOCK(4, 4, 2)
TILE_QK_BLOCK(8, 1, 4) TILE_QK_BLOCK(8, 2, 3) TILE_QK_BLOCK(8, 3, 2) TILE_QK_BLOCK(8, 4, 2)
#if VW == 16
/* The same scores with the queries held in registers: where G heads' queries of one lane pair (2 G
 * NV vectors) fit in 24 of the 32 registers, each lane pair's chains run over up to 8 tokens with
 * no query reloaded, their sums (s8) wait in L1, and the tree adds them afterwards. Per token a
 * multiply-add then needs a third of a load instead of about one: on a Xeon, SmolLM2's 3 heads of
 * 64 take 46 cycles a score vector instead of 52 (the bound, 80 operations at two a cycle: 40). */
#define TILE_QK_HELD(NV, G)                                                                         \
  static void tile_qk_held_##NV##_##G(const vn *qt, const float *k, int64_t count, float scale, vn *s, \
                                      int64_t stride) {                                             \
    const int64_t D = NV * 16;                                                                      \
    vn s8[8][8][G]; /* [lane pair][token][head], count <= 8 tokens */                               \
    for (int l = 0; l < 8; ++l) {                                                                   \
      vn qa[G][NV], qb[G][NV]; /* lanes l and l + 8 of each head's query */                         \
      for (int g = 0; g < G; ++g)                                                                   \
        for (int j = 0; j < NV; ++j) qa[g][j] = qt[g * D + 16 * j + l], qb[g][j] = qt[g * D + 16 * j + l + 8]; \
      for (int64_t t = 0; t < count; ++t) {                                                         \
        const float *kt = k + t * D;                                                                \
        vn a[G], b[G];                                                                              \
        const vn ka = splat(kt[l]), kb = splat(kt[l + 8]);                                          \
        for (int g = 0; g < G; ++g) a[g] = qa[g][0] * ka, b[g] = qb[g][0] * kb;                     \
        for (int j = 1; j < NV; ++j) {                                                              \
          const vn kja = splat(kt[16 * j + l]), kjb = splat(kt[16 * j + l + 8]);                    \
          for (int g = 0; g < G; ++g) a[g] = fmadd(qa[g][j], kja, a[g]), b[g] = fmadd(qb[g][j], kjb, b[g]); \
        }                                                                                           \
        for (int g = 0; g < G; ++g) s8[l][t][g] = a[g] + b[g];                                      \
      }                                                                                             \
    }                                                                                               \
    for (int64_t t = 0; t < count; ++t)                                                             \
      for (int g = 0; g < G; ++g) {                                                                 \
        vn s4[4];                                                                                   \
        for (int m = 0; m < 4; ++m) s4[m] = s8[m][t][g] + s8[m + 4][t][g];                          \
        s[t * stride + g] = ((s4[0] + s4[2]) + (s4[1] + s4[3])) * scale;                            \
      }                                                                                             \
  }
TILE_QK_HELD(4, 1)
TILE_QK_HELD(4, 2)
TILE_QK_HELD(4, 3)
TILE_QK_HELD(8, 1)
#undef TILE_QK_HELD
#define HELD(NV, G) tile_qk_held_##NV##_##G
#else /* 16 registers: the queries cannot stay */
#define HELD(NV, G) tile_qk_##NV##_##G
#endif
static void (*const TILE_QKS_4[5])(const vn *, const float *, int64_t, float, vn *, int64_t) = {
    0, HELD(4, 1), HELD(4, 2), HELD(4, 3), tile_qk_4_4};
static void (*const TILE_QKS_8[5])(const vn *, const float *, int64_t, float, vn *, int64_t) = {
    0, HELD(8, 1), tile_qk_8_2, tile_qk_8_3, tile_qk_8_4};
#undef HELD
#undef TILE_QK
#undef TILE_QK_BLOCK

/* Which rows of a tile see token x: row i sees tokens [0, first + i). */
static inline vni tile_sees(int64_t x, int64_t first) {
#if VW == 16
  const vn lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#elif VW == 8
  const vn lane = {0, 1, 2, 3, 4, 5, 6, 7};
#else
  const vn lane = {0, 1, 2, 3};
#endif
  return x < first ? (vni){0} - 1 : (vni)(lane > splat((float)(x - first)));
}

/* Softmax of one head's scores in a tile (s[x * stride], lane i = row i's score of token x), each
 * row's exactly as softmax() computes it alone: its maximum (the same whatever the order), the same
 * exponentials (in place), its sum as softmax's 16 lanes add it (lane l: the tokens x = l mod 16,
 * in order; then hsum16's order) and the same quotient, returned: each probability is an
 * exponential times it, taken as the weighted sums read them. */
static vn tile_softmax(vn *s, int64_t stride, int64_t first, int64_t n) {
  const int64_t all = first < n ? first : n; /* the tokens every row sees: no mask */
  vn top = (vn){0} - __builtin_inff(), part[16];
  int64_t x = 0;
  for (; x < all; ++x) {
    const vn v = s[x * stride];
    top = vmax(v, top); /* never NaN, as in softmax */
  }
  for (; x < n; ++x) {
    const vn v = s[x * stride];
    const vni above = (vni)(v > top) & tile_sees(x, first);
    top = (vn)(((vni)v & above) | ((vni)top & ~above));
  }
  for (int l = 0; l < 16; ++l) part[l] = (vn){0};
  for (x = 0; x + 16 <= all; x += 16) /* 16 at a time: each lane's sum stays in a register */
#pragma GCC unroll 16
    for (int l = 0; l < 16; ++l) {
      const vn e = expn(s[(x + l) * stride] - top);
      s[(x + l) * stride] = e;
      part[l] += e;
    }
  for (; x < n; ++x) {
    const vn e = expn(s[x * stride] - top);
    s[x * stride] = e;
    part[x & 15] += (vn)((vni)e & tile_sees(x, first)); /* + 0 where the row does not see x: no change */
  }
  vn s8[8], s4[4];
  for (int l = 0; l < 8; ++l) s8[l] = part[l] + part[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  return 1.0f / ((s4[0] + s4[2]) + (s4[1] + s4[3]));
}

/* c + a * b rounded once where `where` is set, c elsewhere. */
static inline vn fmadd_where(vni where, vn a, vn b, vn c) {
#ifdef __AVX512F__
  return (vn)_mm512_mask3_fmadd_ps((__m512)a, (__m512)b, (__m512)c, _mm512_test_epi32_mask((__m512i)where, (__m512i)where));
#else
  const vn r = fmadd(a, b, c);
  return (vn)(((vni)r & where) | ((vni)c & ~where));
#endif
}

/* Prefill's weighted sums: G heads' outputs of a tile's rows (o[g * D + d], lane i = row i, head
 * g, dimension d), DC dimensions at a time, over `count` tokens from x0 (p[x * stride + g]: row i's
 * probability of token x0 + x; v: their values, [count][D] fp32). Each output is decode's chain of
 * multiply-adds over the row's tokens in order; a row skips the tokens it does not see (x0 + x >=
 * first + i). Each value broadcast once feeds G heads of a vector of rows. */
#define TILE_PV(G, DC)                                                                              \
  static void tile_pv_##G(const vn *p, int64_t stride, const float *v, int64_t D, int64_t count, int64_t x0, \
                          int64_t first, vn *o) {                                                   \
    const int64_t all = first - x0 < 0 ? 0 : first - x0 < count ? first - x0 : count; /* seen by every row */ \
    for (int64_t d0 = 0; d0 < D; d0 += DC) {                                                        \
      vn acc[G][DC];                                                                                \
      for (int g = 0; g < G; ++g)                                                                   \
        for (int c = 0; c < DC; ++c) acc[g][c] = o[g * D + d0 + c];                                 \
      int64_t x = 0;                                                                                \
      for (; x < all; ++x)                                                                          \
        for (int c = 0; c < DC; ++c) {                                                              \
          const vn vd = splat(v[x * D + d0 + c]);                                                   \
          for (int g = 0; g < G; ++g) acc[g][c] = fmadd(p[x * stride + g], vd, acc[g][c]);          \
        }                                                                                           \
      for (; x < count; ++x) {                                                                      \
        const vni seen = tile_sees(x0 + x, first);                                                  \
        for (int c = 0; c < DC; ++c) {                                                              \
          const vn vd = splat(v[x * D + d0 + c]);                                                   \
          for (int g = 0; g < G; ++g) acc[g][c] = fmadd_where(seen, p[x * stride + g], vd, acc[g][c]); \
        }                                                                                           \
      }                                                                                             \
      for (int g = 0; g < G; ++g)                                                                   \
        for (int c = 0; c < DC; ++c) o[g * D + d0 + c] = acc[g][c];                                 \
    }                                                                                               \
  }
#if VW == 16 /* G x DC accumulators of the 32 registers */
TILE_PV(1, 16)
TILE_PV(2, 8)
TILE_PV(3, 8)
TILE_PV(4, 4)
#else /* of 16 (AVX2: 12% faster than the AVX-512 shapes) */
TILE_PV(1, 8)
TILE_PV(2, 4)
TILE_PV(3, 4)
TILE_PV(4, 2)
#endif
#undef TILE_PV
static void (*const TILE_PVS[5])(const vn *, int64_t, const float *, int64_t, int64_t, int64_t, int64_t, vn *) = {
    0, tile_pv_1, tile_pv_2, tile_pv_3, tile_pv_4};

/* How many of a tile's `group` heads its score and weighted-sum kernels take at once (at most 4):
 * 4 where they divide the group, else 3, the last chunk what is left. */
static inline int64_t head_chunk(int64_t group, int64_t g0) {
  const int64_t size = group % 4 == 0 ? 4 : 3, left = group - g0;
  return left < size ? left : size;
}

/* RMSNorm of each row, as transformers computes it in fp32: y = w * (x / sqrt(mean(x^2) + eps)).
 * x, y: [R, N] contiguous (y may be x); w: [N] fp32. */
NOIPA void baton_rms_norm(const float *x, const float *w, float *y, int64_t R, int64_t N, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (R >= 64)
  for (int64_t r = 0; r < R; ++r) {
    const float *xr = x + r * N;
    float *yr = y + r * N;
    vn acc[NH] = {{0}};
    int64_t i = 0;
    for (; i + 16 <= N; i += 16)
      for (int h = 0; h < NH; ++h) {
        vn v;
        memcpy(&v, xr + i + h * VW, sizeof(vn));
        acc[h] += v * v;
      }
    float sum = hsum16n(acc);
    for (; i < N; ++i) sum += xr[i] * xr[i];
    const float inv = 1.0f / __builtin_sqrtf(sum / (float)N + eps);
    for (i = 0; i < N; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

/* Rotary embedding in place on the first H heads of each row of x ([N, rows of row_stride
 * floats, heads of D]): x = x * cos + roll(x, D/2) * signed_sin, with cos and signed_sin [N, D]
 * (sin with its first half negated: rotate_half(x) * sin in one product). */
NOIPA void baton_rotary(float *x, int64_t N, int64_t H, int64_t D, int64_t row_stride, const float *cos,
                        const float *signed_sin, int threads) {
  const int64_t half = D / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (N >= 64)
  for (int64_t n = 0; n < N; ++n) {
    const float *c = cos + n * D, *s = signed_sin + n * D;
    for (int64_t h = 0; h < H; ++h) {
      float *xh = x + n * row_stride + h * D;
      for (int64_t i = 0; i < half; ++i) {
        const float a = xh[i], b = xh[i + half];
        xh[i] = a * c[i] + b * s[i];
        xh[i + half] = b * c[i + half] + a * s[i + half];
      }
    }
  }
}

/* silu(gate) * up for each of R rows of [gate (I floats), up (I floats)] -> out [R, I], as torch
 * computes it: gate / (1 + e^-gate) * up (e^-gate capped at e^88, where the quotient is 0 anyway). */
NOIPA void baton_silu_mul(const float *gate_up, float *out, int64_t R, int64_t I, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (R >= 64)
  for (int64_t r = 0; r < R; ++r) {
    const float *g = gate_up + r * 2 * I, *u = g + I;
    float *o = out + r * I;
    int64_t i = 0;
    for (const int64_t whole = I - I % 16; i < whole; i += VW) { /* 16s as on every CPU; the rest one by one */
      vn x, up;
      memcpy(&x, g + i, sizeof(vn));
      memcpy(&up, u + i, sizeof(vn));
      vn minus = -x;
      const vn cap = (vn){0} + 88.0f;
      const vni over = minus > cap;
      minus = (vn)(((vni)cap & over) | ((vni)minus & ~over));
      const vn y = x / (1.0f + expn(minus)) * up;
      memcpy(o + i, &y, sizeof(vn));
    }
    for (; i < I; ++i) o[i] = g[i] / (1.0f + __builtin_expf(-g[i])) * u[i];
  }
}

static inline int64_t max3(int64_t a, int64_t b, int64_t c) {
  const int64_t ab = a > b ? a : b;
  return ab > c ? ab : c;
}

/* The storage types: how VW stored values become a vector of floats, and how a float is stored
 * (rounded to nearest, ties to even, as torch's casts round). */
static inline vn loadn_f32(const float *p) {
  vn v;
  memcpy(&v, p, sizeof(vn));
  return v;
}
static inline float load1_f32(const float *p) { return *p; }
static inline float store1_f32(float x) { return x; }

static inline vn loadn_bf16(const uint16_t *p) {
#ifdef __AVX512F__ /* one widening load and one shift (the generic form compiled to four steps) */
  return (vn)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
  vns s;
  memcpy(&s, p, sizeof(vns));
  return (vn)(__builtin_convertvector(s, vnu) << 16);
#endif
}
static inline float load1_bf16(const uint16_t *p) {
  const uint32_t u = (uint32_t)*p << 16;
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}
static inline uint16_t store1_bf16(float x) {
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN stays a quiet NaN */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#include "quantized.h" /* weights kept in GGUF blocks; the typed kernels call quant_gemm */

/* What this build computes with, for the choices made in Python (kernels.py): floats per vector
 * register, and whether quantized weights' byte dot products have instructions (AVX512-VNNI, AVX2)
 * rather than the portable loop. The build's, not the machine's: $BATON_CPU_MARCH may differ. */
int baton_vector_floats(void) { return VW; }
int baton_quantized_dots(void) { return QUANT_DOTS; }

#define STORAGE f32
#define ELEMENT float
#include "kernels_typed.h"
#undef STORAGE
#undef ELEMENT

#define STORAGE bf16
#define ELEMENT uint16_t
#include "kernels_typed.h"
#undef STORAGE
#undef ELEMENT

#ifdef __FLT16_MAX__ /* compilers with _Float16 (GCC 12+, clang 15+ on x86-64 and aarch64) */
typedef _Float16 vnh __attribute__((vector_size(2 * VW)));
static inline vn loadn_f16(const _Float16 *p) {
  vnh h;
  memcpy(&h, p, sizeof(vnh));
  return __builtin_convertvector(h, vn);
}
static inline float load1_f16(const _Float16 *p) { return (float)*p; }
static inline _Float16 store1_f16(float x) { return (_Float16)x; }
#define STORAGE f16
#define ELEMENT _Float16
#include "kernels_typed.h"
#undef STORAGE
#undef ELEMENT
#endif
