/* Baton's CPU kernels for the decode step (and, where it wins, prefill's GEMMs).
 *
 * baton_small_gemm: y = x @ W^T for the few rows of a decode step, reading each weight once at
 * memory speed; with AVX-512 it also outruns MKL on a prompt's hundreds of rows.
 * baton_decode_layers (at the end): every layer of a decode step in one call, from the kernels
 * here.
 *
 * The weight is packed in panels of 16 output features, k-major: packed[p][k][j] = W[16p + j][k]
 * (zero-padded past N), so one panel is a contiguous stream that a core reads front to back
 * while up to 8 rows accumulate in vector registers, one 16-float vector per row (one AVX-512
 * register, or two AVX2 ones: either way one weight load and one broadcast of x feed 16
 * multiply-adds, and the 4-cycle chain of each accumulator covers 64 bytes of weights, so a few
 * rows stream them at memory speed). Rows beyond 8 are taken 8 at a time while the panel is
 * still in cache. Panels are split between `threads` OpenMP threads (torch's own
 * runtime: libgomp is resolved by soname; the caller passes torch's thread count, since the
 * calling thread's own OpenMP setting may not be torch's).
 * Sums run over k in order with fused multiply-adds: results differ from another GEMM's by
 * rounding only.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
#define PANEL 16
/* Software prefetch, in k steps (cache lines of a panel) ahead: hardware prefetchers stop at page
 * ends. Far ahead into L2 keeps enough lines in flight; near ahead into L1 keeps the demand loads
 * hitting. Into L1 alone from far ahead, the stream evicted the transposed input the broadcasts
 * read, and 8 rows streamed at 16 GB/s instead of 23. */
#define GEMM_PREFETCH_L2 384 /* 24 KiB */
#define GEMM_PREFETCH_L1 64  /* 4 KiB */
typedef float vpanel __attribute__((vector_size(PANEL * sizeof(float))));

#define PANEL_KERNEL(M)                                                                       \
  static void panel_##M(const float *xt, int64_t rows, const float *w, int64_t K, float *out, \
                        int64_t N, int64_t col) {                                             \
    vpanel acc[M];                                                                            \
    for (int m = 0; m < M; ++m) acc[m] = (vpanel){0};                                         \
    for (int64_t k = 0; k < K; ++k) {                                                         \
      vpanel wv;                                                                              \
      __builtin_prefetch(w + (k + GEMM_PREFETCH_L2) * PANEL, 0, 1);                           \
      __builtin_prefetch(w + (k + GEMM_PREFETCH_L1) * PANEL);                                 \
      memcpy(&wv, w + k * PANEL, sizeof(vpanel));                                             \
      const float *xk = xt + k * rows;                                                        \
      for (int m = 0; m < M; ++m) acc[m] += xk[m] * wv;                                       \
    }                                                                                         \
    int64_t width = N - col < PANEL ? N - col : PANEL;                                        \
    for (int m = 0; m < M; ++m) memcpy(out + m * N + col, &acc[m], width * sizeof(float));   \
  }

PANEL_KERNEL(1)
PANEL_KERNEL(2)
PANEL_KERNEL(3)
PANEL_KERNEL(4)
PANEL_KERNEL(5)
PANEL_KERNEL(6)
PANEL_KERNEL(7)
PANEL_KERNEL(8)

typedef void (*panel_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t, int64_t);
static const panel_fn PANELS[9] = {0, panel_1, panel_2, panel_3, panel_4, panel_5, panel_6, panel_7, panel_8};

/* x: [M, K] row-major; packed: [ceil(N / PANEL), K, PANEL]; out: [M, N]; xt: M * K floats of scratch. */
static void gemm(const float *x, const float *packed, float *out, int64_t M, int64_t K, int64_t N, int threads,
                 float *xt) {
  /* x transposed, 8 rows at a time: the rows of one k side by side in one cache line */
  for (int64_t m0 = 0; m0 < M; m0 += 8) {
    int64_t rows = M - m0 < 8 ? M - m0 : 8;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t m = 0; m < rows; ++m) xt[m0 * K + k * rows + m] = x[(m0 + m) * K + k];
  }
  int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t m0 = 0; m0 < M; m0 += 8) {
      int64_t rows = M - m0 < 8 ? M - m0 : 8;
      PANELS[rows](xt + m0 * K, rows, packed + p * K * PANEL, K, out + m0 * N, N, p * PANEL);
    }
  }
}

/* Returns 0, or -1 when out of memory. */
int baton_small_gemm(const float *x, const float *packed, float *out, int64_t M, int64_t K, int64_t N, int threads) {
  float *xt = malloc(sizeof(float) * M * K);
  if (!xt) return -1;
  gemm(x, packed, out, M, K, N, threads, xt);
  free(xt);
  return 0;
}

/* Decode attention over paged KV: one query token per row, keys and values of the row's tokens
 * [0, lengths[r]), token t in page table[r][t / P] at slot t % P (a page holds, per KV head, P
 * tokens of D floats), grouped-query heads. q: [R, Hq, D] rows q_row_stride apart; out: [R, Hq,
 * D]; lse (optional, [R, Hq]): the log-sum-exp of the scaled scores. Softmax in fp32 with the
 * running maximum subtracted, as SDPA does, its exponentials 16 lanes at a time (a scalar expf
 * per score was a third of the kernel's time). */
/* q . k over D floats: eight lanes of partial sums where D allows (no -ffast-math needed) */
static inline float dot(const float *a, const float *b, int64_t D) {
  float s = 0.f;
  int64_t d = 0;
  if (D >= 8) {
    v8 acc = {0, 0, 0, 0, 0, 0, 0, 0};
    for (; d + 8 <= D; d += 8) {
      v8 x, y;
      memcpy(&x, a + d, sizeof(v8));
      memcpy(&y, b + d, sizeof(v8));
      acc += x * y;
    }
    for (int i = 0; i < 8; ++i) s += acc[i];
  }
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

typedef float v16 __attribute__((vector_size(64)));
typedef float v4 __attribute__((vector_size(16)));

static inline float hsum16(v16 x) {
  v8 lo, hi;
  memcpy(&lo, &x, sizeof(v8));
  memcpy(&hi, (const char *)&x + sizeof(v8), sizeof(v8));
  v8 s8 = lo + hi;
  v4 a, b;
  memcpy(&a, &s8, sizeof(v4));
  memcpy(&b, (const char *)&s8 + sizeof(v4), sizeof(v4));
  v4 s4 = a + b;
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

typedef int32_t v16i __attribute__((vector_size(64)));

/* e^x for 16 lanes, x <= 88 (scores minus their maximum, SiLU's capped arguments): 2^n e^r with
 * |r| <= ln2 / 2 and Cephes' degree-6 polynomial for e^r, within 2 ulp of expf; below -87.3 it
 * gives ~1e-38, not 0. */
static inline v16 exp16(v16 x) {
  const v16 lo = {0}, floor_x = lo - 87.3f;
  const v16i below = x < floor_x; /* all ones where x is below: take floor_x there */
  x = (v16)(((v16i)floor_x & below) | ((v16i)x & ~below));
  const v16 magic = lo + 12582912.0f; /* 1.5 * 2^23: adding it rounds to an integer, kept in the low bits */
  v16 t = x * 1.44269504088896341f + magic;
  const v16i n = (v16i)t - (v16i)magic;
  t -= magic;
  v16 r = x - t * 0.693359375f;
  r = r - t * -2.12194440e-4f;
  v16 p = lo + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  return p * (v16)((n + 127) << 23);
}

/* Softmax of one head's scores in place (probabilities), returns its log-sum-exp. */
static float softmax(float *s, int64_t n) {
  float top = -__builtin_inff();
  for (int64_t t = 0; t < n; ++t) top = s[t] > top ? s[t] : top;
  v16 sum = {0};
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    v16 x;
    memcpy(&x, s + t, sizeof(v16));
    x = exp16(x - top);
    memcpy(s + t, &x, sizeof(v16));
    sum += x;
  }
  if (t < n) { /* the last few: lanes past the end count as nothing */
    v16 x = {0};
    memcpy(&x, s + t, sizeof(float) * (n - t));
    x = exp16(x - top);
    for (int64_t i = 0; i < n - t; ++i) sum[i] += x[i];
    memcpy(s + t, &x, sizeof(float) * (n - t));
  }
  const float total = hsum16(sum);
  const float inv = 1.0f / total;
  for (t = 0; t < n; ++t) s[t] *= inv;
  return top + __builtin_logf(total);
}

/* One (row, KV head) whose head_dim is NV x 16 floats: the group's queries and each key, and
 * each head's output, live in vector registers; every key and value is read once for the group.
 * kp, vp: the row's pages for this head (P tokens of D floats each), n tokens in all. While a
 * page is read, the same line of the next page is prefetched: hardware prefetchers stop at page
 * boundaries, and the next page may be anywhere. */
#define GROUP_ATTENTION(NV)                                                                       \
  static void group_attention_##NV(const float *qg, const float *const *kp, const float *const *vp, \
                                   int64_t n, int64_t P, int64_t group, float scale, float *scores, \
                                   float *og, float *lse) {                                       \
    const int64_t pages = (n + P - 1) / P, D = NV * 16;                                           \
    for (int64_t g0 = 0; g0 < group; g0 += 4) { /* four heads at a time keep q in registers */  \
      const int64_t heads = group - g0 < 4 ? group - g0 : 4;                                      \
      v16 qv[4][NV];                                                                              \
      for (int64_t g = 0; g < heads; ++g)                                                         \
        for (int j = 0; j < NV; ++j) memcpy(&qv[g][j], qg + (g0 + g) * D + 16 * j, 64);          \
      for (int64_t i = 0; i < pages; ++i) {                                                       \
        const float *kb = kp[i], *next = kp[i + 1 < pages ? i + 1 : i];                           \
        const int64_t count = n - i * P < P ? n - i * P : P;                                      \
        for (int64_t t = 0; t < count; ++t) {                                                     \
          const float *k = kb + t * D;                                                            \
          for (int j = 0; j < NV; ++j) __builtin_prefetch(next + t * D + 16 * j);                \
          v16 kv[NV];                                                                             \
          for (int j = 0; j < NV; ++j) memcpy(&kv[j], k + 16 * j, 64);                            \
          for (int64_t g = 0; g < heads; ++g) {                                                   \
            v16 acc = qv[g][0] * kv[0];                                                           \
            for (int j = 1; j < NV; ++j) acc += qv[g][j] * kv[j];                                 \
            scores[(g0 + g) * n + i * P + t] = hsum16(acc) * scale;                               \
          }                                                                                       \
        }                                                                                         \
      }                                                                                           \
    }                                                                                             \
    for (int64_t g = 0; g < group; ++g) {                                                         \
      const float l = softmax(scores + g * n, n);                                                 \
      if (lse) lse[g] = l;                                                                        \
    }                                                                                             \
    for (int64_t g0 = 0; g0 < group; g0 += 4) { /* each value once for four heads' outputs */    \
      const int64_t heads = group - g0 < 4 ? group - g0 : 4;                                      \
      const float *p = scores + g0 * n;                                                           \
      v16 o[4][NV];                                                                               \
      for (int64_t g = 0; g < heads; ++g)                                                         \
        for (int j = 0; j < NV; ++j) o[g][j] = (v16){0};                                          \
      for (int64_t i = 0; i < pages; ++i) {                                                       \
        const float *vb = vp[i], *next = vp[i + 1 < pages ? i + 1 : i];                           \
        const int64_t count = n - i * P < P ? n - i * P : P;                                      \
        for (int64_t t = 0; t < count; ++t) {                                                     \
          const float *v = vb + t * D;                                                            \
          for (int j = 0; j < NV; ++j) __builtin_prefetch(next + t * D + 16 * j);                \
          v16 vv[NV];                                                                             \
          for (int j = 0; j < NV; ++j) memcpy(&vv[j], v + 16 * j, 64);                            \
          for (int64_t g = 0; g < heads; ++g)                                                     \
            for (int j = 0; j < NV; ++j) o[g][j] += p[g * n + i * P + t] * vv[j];                 \
        }                                                                                         \
      }                                                                                           \
      for (int64_t g = 0; g < heads; ++g) memcpy(og + (g0 + g) * D, o[g], sizeof(o[g]));          \
    }                                                                                             \
  }

GROUP_ATTENTION(4)
GROUP_ATTENTION(8)

/* Any head_dim: the same maths with plain loops. */
static void group_attention_any(const float *qg, const float *const *kp, const float *const *vp, int64_t n,
                                int64_t P, int64_t group, int64_t D, float scale, float *scores, float *og,
                                float *lse) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t g = 0; g < group; ++g) scores[g * n + t] = dot(qg + g * D, kp[t / P] + (t % P) * D, D) * scale;
  for (int64_t g = 0; g < group; ++g) {
    float *p = scores + g * n, *o = og + g * D;
    const float l = softmax(p, n);
    if (lse) lse[g] = l;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      const float *v = vp[t / P] + (t % P) * D;
      for (int64_t d = 0; d < D; ++d) o[d] += p[t] * v[d];
    }
  }
}

/* keys, values: one layer's pages, page p's head h at p * page_stride + h * head_stride floats,
 * its tokens D floats apart; table: [R] rows table_stride apart; q_row_stride: floats from one
 * row's query heads to the next's (Hq * D when contiguous, more when the queries are read in
 * place from a fused QKV projection). */
static int attention(const float *q, int64_t q_row_stride, const float *keys, const float *values,
                     const int64_t *table, int64_t table_stride, const int64_t *lengths, float *out, float *lse,
                     int64_t R, int64_t Hq, int64_t Hkv, int64_t D, int64_t P, int64_t page_stride,
                     int64_t head_stride, float scale, int threads) {
  const int64_t group = Hq / Hkv;
  int failed = 0;
  /* One program per (row, KV head): its `group` query heads take each key and value as it is
   * read, so the row's tokens are streamed once, not once per query head. */
#pragma omp parallel for schedule(static) reduction(| : failed) num_threads(threads)
  for (int64_t rk = 0; rk < R * Hkv; ++rk) {
    const int64_t r = rk / Hkv, kvh = rk % Hkv;
    const int64_t n = lengths[r], pages = (n + P - 1) / P;
    const float *qg = q + r * q_row_stride + kvh * group * D; /* the group's heads, [group, D] */
    float *og = out + (r * Hq + kvh * group) * D;
    float *lg = lse ? lse + r * Hq + kvh * group : 0;
    if (n <= 0) { /* nothing to attend: zeros, and a log-sum-exp of -inf */
      for (int64_t i = 0; i < group * D; ++i) og[i] = 0.f;
      if (lg) for (int64_t g = 0; g < group; ++g) lg[g] = -__builtin_inff();
      continue;
    }
    /* scores [group, n], then the row's page addresses for keys and values */
    float *scores = malloc(sizeof(float) * group * n + sizeof(float *) * 2 * pages);
    if (!scores) { failed = 1; continue; }
    const float **kp = (const float **)(scores + group * n), **vp = kp + pages;
    for (int64_t i = 0; i < pages; ++i) {
      const int64_t at = table[r * table_stride + i] * page_stride + kvh * head_stride;
      kp[i] = keys + at;
      vp[i] = values + at;
    }
    if (D == 64)
      group_attention_4(qg, kp, vp, n, P, group, scale, scores, og, lg);
    else if (D == 128)
      group_attention_8(qg, kp, vp, n, P, group, scale, scores, og, lg);
    else
      group_attention_any(qg, kp, vp, n, P, group, D, scale, scores, og, lg);
    free(scores);
  }
  return failed ? -1 : 0;
}

int baton_decode_attention(const float *q, const float *keys, const float *values, const int64_t *table,
                           int64_t table_stride, const int64_t *lengths, float *out, float *lse, int64_t R,
                           int64_t Hq, int64_t Hkv, int64_t D, int64_t P, int64_t page_stride, int64_t head_stride,
                           float scale, int threads) {
  return attention(q, Hq * D, keys, values, table, table_stride, lengths, out, lse, R, Hq, Hkv, D, P, page_stride,
                   head_stride, scale, threads);
}

/* RMSNorm of each row, as transformers computes it in fp32: y = w * (x / sqrt(mean(x^2) + eps)).
 * x, y: [R, N] contiguous (y may be x); w: [N]. */
void baton_rms_norm(const float *x, const float *w, float *y, int64_t R, int64_t N, float eps, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) if (R >= 64)
  for (int64_t r = 0; r < R; ++r) {
    const float *xr = x + r * N;
    float *yr = y + r * N;
    v16 acc = {0};
    int64_t i = 0;
    for (; i + 16 <= N; i += 16) {
      v16 v;
      memcpy(&v, xr + i, sizeof(v16));
      acc += v * v;
    }
    float sum = hsum16(acc);
    for (; i < N; ++i) sum += xr[i] * xr[i];
    const float inv = 1.0f / __builtin_sqrtf(sum / (float)N + eps);
    for (i = 0; i < N; ++i) yr[i] = w[i] * (xr[i] * inv);
  }
}

/* Rotary embedding in place on the first H heads of each row of x ([N, rows of row_stride
 * floats, heads of D]): x = x * cos + roll(x, D/2) * signed_sin, with cos and signed_sin [N, D]
 * (sin with its first half negated: rotate_half(x) * sin in one product). */
void baton_rotary(float *x, int64_t N, int64_t H, int64_t D, int64_t row_stride, const float *cos,
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
static void silu_mul(const float *gate_up, float *out, int64_t R, int64_t I) {
  for (int64_t r = 0; r < R; ++r) {
    const float *g = gate_up + r * 2 * I, *u = g + I;
    float *o = out + r * I;
    int64_t i = 0;
    for (; i + 16 <= I; i += 16) {
      v16 x, up;
      memcpy(&x, g + i, sizeof(v16));
      memcpy(&up, u + i, sizeof(v16));
      v16 minus = -x;
      const v16 cap = (v16){0} + 88.0f;
      const v16i over = minus > cap;
      minus = (v16)(((v16i)cap & over) | ((v16i)minus & ~over));
      const v16 y = x / (1.0f + exp16(minus)) * up;
      memcpy(o + i, &y, sizeof(v16));
    }
    for (; i < I; ++i) o[i] = g[i] / (1.0f + __builtin_expf(-g[i])) * u[i];
  }
}

static inline int64_t max3(int64_t a, int64_t b, int64_t c) {
  const int64_t ab = a > b ? a : b;
  return ab > c ? ab : c;
}

/* One decode step through every decoder layer of a Llama-family model, in one call: for each
 * layer, RMSNorm, fused QKV (+ bias), rotary on queries and keys, the new keys and values written
 * into each row's next slot, attention over each row's tokens, the output projection added
 * to the residual, RMSNorm, fused gate/up, SiLU-and-multiply, down projection added to the
 * residual. The same operations, in the same order and with the same kernels, as the per-layer
 * Python path; what it saves is ~35 Python-level calls a layer.
 *
 * h: [R, H] the residual stream, updated in place. weights: per layer 7 addresses (input norm,
 * packed QKV, QKV bias or 0, packed O, post norm, packed gate/up, packed down). cos, signed_sin:
 * [R, D]. kv: the paged KV [layers, 2, pages, Hkv, P, D] given by its strides in floats; table:
 * each row's pages (table_stride apart); lengths: each row's tokens, this step's included, which
 * is written at position lengths[r] - 1. Returns 0, or -1 when out of memory. */
int baton_decode_layers(float *h, const int64_t *weights, int64_t L, int64_t R, int64_t H, int64_t Hq,
                        int64_t Hkv, int64_t D, int64_t I, float eps, float scale, const float *cos,
                        const float *signed_sin, float *kv, int64_t layer_stride, int64_t kind_stride,
                        int64_t page_stride, int64_t head_stride, int64_t P, const int64_t *table,
                        int64_t table_stride, const int64_t *lengths, int threads) {
  /* scratch for the widest input (the GEMMs' K: H, I, or Hq * D for the output projection, which
   * need not equal H) and the widest output (N: QKV, 2 * I or H) */
  const int64_t QKV = (Hq + 2 * Hkv) * D, K_MAX = max3(H, I, Hq * D), N_MAX = max3(QKV, 2 * I, H);
  float *x = malloc(sizeof(float) * R * K_MAX), *y = malloc(sizeof(float) * R * N_MAX);
  float *attn = malloc(sizeof(float) * R * Hq * D), *xt = malloc(sizeof(float) * R * K_MAX);
  int failed = !x || !y || !attn || !xt;
  for (int64_t l = 0; l < L && !failed; ++l) {
    const float *const *w = (const float *const *)(weights + 7 * l);
    const float *input_norm = w[0], *qkv = w[1], *qkv_bias = w[2], *o = w[3], *post_norm = w[4];
    const float *gate_up = w[5], *down = w[6];
    float *keys = kv + l * layer_stride, *values = keys + kind_stride;

    baton_rms_norm(h, input_norm, x, R, H, eps, threads);
    gemm(x, qkv, y, R, H, QKV, threads, xt);
    if (qkv_bias)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < QKV; ++i) y[r * QKV + i] += qkv_bias[i];
    baton_rotary(y, R, Hq + Hkv, D, QKV, cos, signed_sin, threads);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
        const int64_t pos = lengths[r] - 1;
        const int64_t at = table[r * table_stride + pos / P] * page_stride + kvh * head_stride + (pos % P) * D;
        memcpy(keys + at, y + r * QKV + (Hq + kvh) * D, sizeof(float) * D);
        memcpy(values + at, y + r * QKV + (Hq + Hkv + kvh) * D, sizeof(float) * D);
      }
    failed = attention(y, QKV, keys, values, table, table_stride, lengths, attn, 0, R, Hq, Hkv, D, P, page_stride,
                       head_stride, scale, threads);
    gemm(attn, o, y, R, Hq * D, H, threads, xt);
    for (int64_t i = 0; i < R * H; ++i) h[i] += y[i];

    baton_rms_norm(h, post_norm, x, R, H, eps, threads);
    gemm(x, gate_up, y, R, H, 2 * I, threads, xt);
    silu_mul(y, x, R, I);
    gemm(x, down, y, R, I, H, threads, xt);
    for (int64_t i = 0; i < R * H; ++i) h[i] += y[i];
  }
  free(x), free(y), free(attn), free(xt);
  return failed ? -1 : 0;
}
