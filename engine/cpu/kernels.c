/* Baton's CPU kernels for the decode step.
 *
 * baton_small_gemm: y = x @ W^T for the few rows of a decode step, reading each weight once at
 * memory speed.
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
typedef float vpanel __attribute__((vector_size(PANEL * sizeof(float))));

#define PANEL_KERNEL(M)                                                                       \
  static void panel_##M(const float *xt, int64_t rows, const float *w, int64_t K, float *out, \
                        int64_t N, int64_t col) {                                             \
    vpanel acc[M];                                                                            \
    for (int m = 0; m < M; ++m) acc[m] = (vpanel){0};                                         \
    for (int64_t k = 0; k < K; ++k) {                                                         \
      vpanel wv;                                                                              \
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

/* x: [M, K] row-major; packed: [ceil(N / PANEL), K, PANEL]; out: [M, N]. Returns 0, or -1 when out of memory. */
int baton_small_gemm(const float *x, const float *packed, float *out, int64_t M, int64_t K, int64_t N, int threads) {
  /* x transposed, 8 rows at a time: the rows of one k side by side in one cache line */
  float *xt = malloc(sizeof(float) * M * K);
  if (!xt) return -1;
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
  free(xt);
  return 0;
}

/* Decode attention over the BATON window: one query token per row, keys and values of the
 * window [start_r, W) of each row (columns before start_r are padding and are skipped, not
 * masked), grouped-query heads. q: [R, Hq, D] contiguous; keys/values: strided views of the
 * batch buffer (row, head and token strides in floats); out: [R, Hq, D]; lse (optional, [R, Hq]):
 * the log-sum-exp of the scaled scores, for merging with a shared prefix's part. Softmax in fp32
 * with the running maximum subtracted, as SDPA does. */
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

int baton_decode_attention(const float *q, const float *keys, const float *values, const int64_t *starts,
                           float *out, float *lse, int64_t R, int64_t Hq, int64_t Hkv, int64_t W, int64_t D,
                           int64_t row_stride, int64_t head_stride, int64_t token_stride, float scale,
                           int threads) {
  const int64_t group = Hq / Hkv;
  int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed) num_threads(threads)
  for (int64_t rh = 0; rh < R * Hq; ++rh) {
    const int64_t r = rh / Hq, h = rh % Hq, kvh = h / group;
    const int64_t start = starts[r], n = W - start;
    const float *qv = q + (r * Hq + h) * D;
    const float *kb = keys + r * row_stride + kvh * head_stride + start * token_stride;
    const float *vb = values + r * row_stride + kvh * head_stride + start * token_stride;
    float *o = out + (r * Hq + h) * D;
    float *scores = malloc(sizeof(float) * (n > 0 ? n : 1));
    if (!scores) { failed = 1; continue; }
    float top = -__builtin_inff();
    for (int64_t t = 0; t < n; ++t) {
      const float s = dot(qv, kb + t * token_stride, D) * scale;
      scores[t] = s;
      if (s > top) top = s;
    }
    float total = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      scores[t] = __builtin_expf(scores[t] - top);
      total += scores[t];
    }
    for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      const float *v = vb + t * token_stride;
      const float p = scores[t] / total;
      for (int64_t d = 0; d < D; ++d) o[d] += p * v[d];
    }
    if (lse) lse[r * Hq + h] = top + __builtin_logf(total);
    free(scores);
  }
  return failed ? -1 : 0;
}
