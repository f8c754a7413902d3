/* The kernels that read stored weights and KV, for one storage type: kernels.c includes this once
 * per type with STORAGE (the name suffix: f32, bf16, f16) and ELEMENT (the C type) defined, and
 * loadn_STORAGE / load1_STORAGE / store1_STORAGE in scope. Everything is computed in fp32. */
#define NAME(x) CAT(x, STORAGE)
#define LOADN NAME(loadn)
#define LOAD1 NAME(load1)
#define STORE1 NAME(store1)

#define PANEL_KERNEL(M)                                                                            \
  static NOIPA void NAME(panel_##M)(const float *xt, int64_t rows, const ELEMENT *w, int64_t K,    \
                                    float *out, int64_t N, int64_t col) {                          \
    vn acc[M][NH];                                                                                 \
    for (int m = 0; m < M; ++m)                                                                    \
      for (int h = 0; h < NH; ++h) acc[m][h] = (vn){0};                                            \
    for (int64_t k = 0; k < K; ++k) {                                                              \
      const ELEMENT *wk = w + k * PANEL;                                                           \
      __builtin_prefetch((const char *)wk + GEMM_PREFETCH_L2, 0, 1);                               \
      __builtin_prefetch((const char *)wk + GEMM_PREFETCH_L1);                                     \
      vn wv[NH];                                                                                   \
      for (int h = 0; h < NH; ++h) wv[h] = LOADN(wk + h * VW);                                     \
      const float *xk = xt + k * rows;                                                             \
      for (int m = 0; m < M; ++m)                                                                  \
        for (int h = 0; h < NH; ++h) acc[m][h] += xk[m] * wv[h];                                   \
    }                                                                                              \
    int64_t width = N - col < PANEL ? N - col : PANEL;                                             \
    for (int m = 0; m < M; ++m) memcpy(out + m * N + col, &acc[m], width * sizeof(float));         \
  }

PANEL_KERNEL(1)
PANEL_KERNEL(2)
PANEL_KERNEL(3)
PANEL_KERNEL(4)
PANEL_KERNEL(5)
PANEL_KERNEL(6)
PANEL_KERNEL(7)
PANEL_KERNEL(8)
#undef PANEL_KERNEL

static void (*const NAME(PANELS)[9])(const float *, int64_t, const ELEMENT *, int64_t, float *, int64_t, int64_t) = {
    0, NAME(panel_1), NAME(panel_2), NAME(panel_3), NAME(panel_4),
    NAME(panel_5), NAME(panel_6), NAME(panel_7), NAME(panel_8)};

#ifdef __AVX512F__
/* Two neighbouring panels at once (32 registers hold 2 x M accumulators): each broadcast of x feeds
 * 32 outputs, so rows that are compute-bound (8 rows of bf16, prefill) issue half the loads per
 * multiply-add. The sums are the one-panel kernel's, term for term. */
#define PANEL_PAIR_KERNEL(M)                                                                       \
  static NOIPA void NAME(panel_pair_##M)(const float *xt, int64_t rows, const ELEMENT *w, int64_t K, \
                                         float *out, int64_t N, int64_t col) {                     \
    const ELEMENT *w2 = w + K * PANEL;                                                             \
    v16 acc[M], acc2[M];                                                                           \
    for (int m = 0; m < M; ++m) acc[m] = acc2[m] = (v16){0};                                       \
    for (int64_t k = 0; k < K; ++k) {                                                              \
      const ELEMENT *wk = w + k * PANEL, *wk2 = w2 + k * PANEL;                                    \
      __builtin_prefetch((const char *)wk + GEMM_PREFETCH_L2, 0, 1);                               \
      __builtin_prefetch((const char *)wk + GEMM_PREFETCH_L1);                                     \
      __builtin_prefetch((const char *)wk2 + GEMM_PREFETCH_L2, 0, 1);                              \
      __builtin_prefetch((const char *)wk2 + GEMM_PREFETCH_L1);                                    \
      const v16 wv = LOADN(wk), wv2 = LOADN(wk2);                                                  \
      const float *xk = xt + k * rows;                                                             \
      for (int m = 0; m < M; ++m) {                                                                \
        acc[m] += xk[m] * wv;                                                                      \
        acc2[m] += xk[m] * wv2;                                                                    \
      }                                                                                            \
    }                                                                                              \
    const int64_t width = N - col - PANEL < PANEL ? N - col - PANEL : PANEL;                       \
    for (int m = 0; m < M; ++m) {                                                                  \
      memcpy(out + m * N + col, &acc[m], PANEL * sizeof(float));                                   \
      memcpy(out + m * N + col + PANEL, &acc2[m], width * sizeof(float));                          \
    }                                                                                              \
  }

PANEL_PAIR_KERNEL(1)
PANEL_PAIR_KERNEL(2)
PANEL_PAIR_KERNEL(3)
PANEL_PAIR_KERNEL(4)
PANEL_PAIR_KERNEL(5)
PANEL_PAIR_KERNEL(6)
PANEL_PAIR_KERNEL(7)
PANEL_PAIR_KERNEL(8)
#undef PANEL_PAIR_KERNEL

static void (*const NAME(PANEL_PAIRS)[9])(const float *, int64_t, const ELEMENT *, int64_t, float *, int64_t,
                                          int64_t) = {
    0, NAME(panel_pair_1), NAME(panel_pair_2), NAME(panel_pair_3), NAME(panel_pair_4),
    NAME(panel_pair_5), NAME(panel_pair_6), NAME(panel_pair_7), NAME(panel_pair_8)};
#endif

/* y = x @ W^T. x: [M, K] fp32 row-major; packed: [ceil(N / PANEL), K, PANEL]; out: [M, N] fp32;
 * xt: M * K floats of scratch. Each row's sums run over k in order: its result does not depend on M. */
static void NAME(gemm)(const float *x, const ELEMENT *packed, float *out, int64_t M, int64_t K, int64_t N,
                       int threads, float *xt) {
  /* x transposed, GEMM_ROWS rows at a time: the rows of one k side by side in one cache line */
  for (int64_t m0 = 0; m0 < M; m0 += GEMM_ROWS) {
    int64_t rows = M - m0 < GEMM_ROWS ? M - m0 : GEMM_ROWS;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t m = 0; m < rows; ++m) xt[m0 * K + k * rows + m] = x[(m0 + m) * K + k];
  }
  const int64_t panels = (N + PANEL - 1) / PANEL;
#ifdef __AVX512F__
  const int64_t step = 2; /* a pair of panels per task; a last odd panel alone */
#else
  const int64_t step = 1;
#endif
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t p = 0; p < panels; p += step) {
    for (int64_t m0 = 0; m0 < M; m0 += GEMM_ROWS) {
      const int64_t rows = M - m0 < GEMM_ROWS ? M - m0 : GEMM_ROWS;
#ifdef __AVX512F__
      if (p + 1 < panels) {
        NAME(PANEL_PAIRS)[rows](xt + m0 * K, rows, packed + p * K * PANEL, K, out + m0 * N, N, p * PANEL);
        continue;
      }
#endif
      NAME(PANELS)[rows](xt + m0 * K, rows, packed + p * K * PANEL, K, out + m0 * N, N, p * PANEL);
    }
  }
}

/* Returns 0, or -1 when out of memory. */
int NAME(baton_small_gemm)(const float *x, const ELEMENT *packed, float *out, int64_t M, int64_t K, int64_t N,
                           int threads) {
  float *xt = malloc(sizeof(float) * M * K);
  if (!xt) return -1;
  NAME(gemm)(x, packed, out, M, K, N, threads, xt);
  free(xt);
  return 0;
}

/* A linear layer whose weight is panels of ELEMENT (FORMAT_FLOAT) or quantized panels (format:
 * the quantized format, plus FORMAT_16_BIT_INPUTS where its inputs are quantized to 16 bits
 * rather than 8). */
static int NAME(linear)(int64_t format, const float *x, const void *w, float *out, int64_t M, int64_t K, int64_t N,
                        int threads, float *xt) {
  if (format == FORMAT_FLOAT) {
    NAME(gemm)(x, (const ELEMENT *)w, out, M, K, N, threads, xt);
    return 0;
  }
  return quant_gemm(format % FORMAT_16_BIT_INPUTS, format / FORMAT_16_BIT_INPUTS, x, (const uint8_t *)w, out, M, K, N,
                    threads);
}

/* Attention of one (query token, KV head): its `group` query heads (qg, [group, D] fp32) over n
 * tokens held in `segs` segments (pages, or a cached prefix and the prompt's own tokens): segment
 * i holds counts[i] tokens of D values from kp[i] (keys) and vp[i] (values). Scores, softmax and
 * the weighted sum run over the tokens in order, so the result depends on the tokens alone, not on
 * how they are split. With head_dim NV x 16, the group's queries and each key, and each head's
 * output, live in vector registers; every key and value is read once for four heads. A score is
 * a vector of products, lane l the chain q[l] k[l], + q[16 + l] k[16 + l], ... (multiply-adds
 * written out, not left to the compiler's contraction: prefill's tile_qk computes the same
 * chains), its 16 lanes summed in hsum16's order. While a
 * segment is read, the same line of the next one is prefetched: hardware prefetchers stop at
 * page boundaries, and the next page may be anywhere. scores: group * n floats of scratch. */
#ifdef __AVX512F__ /* a key's products per head wait in `products` until 16 are summed together */
#define SCORE_BLOCK 16
#define SCORE(g, acc) products[g][SLOT16(filled)] = (acc)[0]
#define SCORES_DONE(count)                                                                          \
  for (int64_t g = 0; g < heads; ++g) hsum16x16(products[g], scale, scores + (g0 + g) * n + block, count)
#define PV_HEADS 4
#else
#define SCORE_BLOCK 1
#define SCORE(g, acc) scores[(g0 + (g)) * n + block] = hsum16n(acc) * scale
#define SCORES_DONE(count) (void)products
#define PV_HEADS 2 /* 16 registers: two heads' outputs of head_dim 64 */
#endif
#define GROUP_ATTENTION(NV)                                                                         \
  static NOIPA void NAME(group_attention_##NV)(const float *qg, const ELEMENT *const *kp,           \
                                               const ELEMENT *const *vp, const int64_t *counts,     \
                                               int64_t segs, int64_t n, int64_t group, float scale, \
                                               float *scores, float *og, float *lse) {              \
    const int64_t D = NV * 16, lines = (D * (int64_t)sizeof(ELEMENT) + 63) / 64;                    \
    for (int64_t g0 = 0; g0 < group; g0 += 4) { /* four heads at a time keep q in registers */      \
      const int64_t heads = group - g0 < 4 ? group - g0 : 4;                                        \
      vn qv[4][NV][NH], products[4][SCORE_BLOCK];                                                   \
      for (int64_t g = 0; g < heads; ++g)                                                           \
        for (int j = 0; j < NV; ++j)                                                                \
          for (int h = 0; h < NH; ++h) memcpy(&qv[g][j][h], qg + (g0 + g) * D + 16 * j + h * VW, sizeof(vn)); \
      int64_t filled = 0, block = 0; /* products waiting to be summed, 16 tokens at a time */       \
      for (int64_t i = 0; i < segs; ++i) {                                                          \
        const ELEMENT *kb = kp[i], *next = kp[i + 1 < segs ? i + 1 : i];                            \
        for (int64_t t = 0; t < counts[i]; ++t) {                                                   \
          const ELEMENT *k = kb + t * D;                                                            \
          for (int64_t j = 0; j < lines; ++j) __builtin_prefetch((const char *)(next + t * D) + 64 * j); \
          vn kv[NV][NH];                                                                            \
          for (int j = 0; j < NV; ++j)                                                              \
            for (int h = 0; h < NH; ++h) kv[j][h] = LOADN(k + 16 * j + h * VW);                     \
          for (int64_t g = 0; g < heads; ++g) {                                                     \
            vn acc[NH]; /* lane l: q[l] k[l], then + q[16j + l] k[16j + l], j in order */           \
            for (int h = 0; h < NH; ++h) {                                                          \
              acc[h] = qv[g][0][h] * kv[0][h];                                                      \
              for (int j = 1; j < NV; ++j) acc[h] = fmadd(qv[g][j][h], kv[j][h], acc[h]);           \
            }                                                                                       \
            SCORE(g, acc);                                                                          \
          }                                                                                         \
          if (++filled == SCORE_BLOCK) {                                                            \
            SCORES_DONE(SCORE_BLOCK);                                                               \
            block += SCORE_BLOCK, filled = 0;                                                       \
          }                                                                                         \
        }                                                                                           \
      }                                                                                             \
      if (filled) SCORES_DONE(filled);                                                              \
    }                                                                                               \
    for (int64_t g = 0; g < group; ++g) {                                                           \
      const float l = softmax(scores + g * n, n);                                                   \
      if (lse) lse[g] = l;                                                                          \
    }                                                                                               \
    for (int64_t g0 = 0; g0 < group; g0 += PV_HEADS) { /* each value once for several heads */      \
      const int64_t heads = group - g0 < PV_HEADS ? group - g0 : PV_HEADS;                          \
      const float *p = scores + g0 * n;                                                             \
      vn o[PV_HEADS][NV][NH];                                                                       \
      for (int64_t g = 0; g < heads; ++g)                                                           \
        for (int j = 0; j < NV; ++j)                                                                \
          for (int h = 0; h < NH; ++h) o[g][j][h] = (vn){0};                                        \
      for (int64_t i = 0, at = 0; i < segs; at += counts[i], ++i) {                                 \
        const ELEMENT *vb = vp[i], *next = vp[i + 1 < segs ? i + 1 : i];                            \
        for (int64_t t = 0; t < counts[i]; ++t) {                                                   \
          const ELEMENT *v = vb + t * D;                                                            \
          for (int64_t j = 0; j < lines; ++j) __builtin_prefetch((const char *)(next + t * D) + 64 * j); \
          vn vv[NV][NH];                                                                            \
          for (int j = 0; j < NV; ++j)                                                              \
            for (int h = 0; h < NH; ++h) vv[j][h] = LOADN(v + 16 * j + h * VW);                     \
          for (int64_t g = 0; g < heads; ++g) {                                                     \
            const vn pg = splat(p[g * n + at + t]);                                                 \
            for (int j = 0; j < NV; ++j)                                                            \
              for (int h = 0; h < NH; ++h) o[g][j][h] = fmadd(pg, vv[j][h], o[g][j][h]);            \
          }                                                                                         \
        }                                                                                           \
      }                                                                                             \
      for (int64_t g = 0; g < heads; ++g) memcpy(og + (g0 + g) * D, o[g], sizeof(o[g]));            \
    }                                                                                               \
  }

GROUP_ATTENTION(4)
GROUP_ATTENTION(8)
#undef GROUP_ATTENTION
#undef SCORE_BLOCK
#undef SCORE
#undef SCORES_DONE
#undef PV_HEADS

/* Any head_dim: the same maths with plain loops. */
static NOIPA void NAME(group_attention_any)(const float *qg, const ELEMENT *const *kp, const ELEMENT *const *vp,
                                            const int64_t *counts, int64_t segs, int64_t n, int64_t group,
                                            int64_t D, float scale, float *scores, float *og, float *lse) {
  for (int64_t i = 0, at = 0; i < segs; at += counts[i], ++i)
    for (int64_t t = 0; t < counts[i]; ++t)
      for (int64_t g = 0; g < group; ++g) {
        float s = 0.f;
        for (int64_t d = 0; d < D; ++d) s += qg[g * D + d] * LOAD1(kp[i] + t * D + d);
        scores[g * n + at + t] = s * scale;
      }
  for (int64_t g = 0; g < group; ++g) {
    float *p = scores + g * n, *o = og + g * D;
    const float l = softmax(p, n);
    if (lse) lse[g] = l;
    for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
    for (int64_t i = 0, at = 0; i < segs; at += counts[i], ++i)
      for (int64_t t = 0; t < counts[i]; ++t)
        for (int64_t d = 0; d < D; ++d) o[d] += p[at + t] * LOAD1(vp[i] + t * D + d);
  }
}

/* One (query token, KV head) over its segments; n = the sum of counts. Zeros (and a log-sum-exp of
 * -inf) when there is nothing to attend. Returns -1 when out of memory. */
static int NAME(attend)(const float *qg, const ELEMENT *const *kp, const ELEMENT *const *vp, const int64_t *counts,
                        int64_t segs, int64_t n, int64_t group, int64_t D, float scale, float *og, float *lg) {
  if (n <= 0) {
    for (int64_t i = 0; i < group * D; ++i) og[i] = 0.f;
    if (lg) for (int64_t g = 0; g < group; ++g) lg[g] = -__builtin_inff();
    return 0;
  }
  float *scores = malloc(sizeof(float) * group * n);
  if (!scores) return -1;
  if (D == 64)
    NAME(group_attention_4)(qg, kp, vp, counts, segs, n, group, scale, scores, og, lg);
  else if (D == 128)
    NAME(group_attention_8)(qg, kp, vp, counts, segs, n, group, scale, scores, og, lg);
  else
    NAME(group_attention_any)(qg, kp, vp, counts, segs, n, group, D, scale, scores, og, lg);
  free(scores);
  return 0;
}

/* Decode attention over paged KV: one query token per row, keys and values of the row's tokens
 * [0, lengths[r]), token t in page table[r][t / P] at slot t % P (a page holds, per KV head, P
 * tokens of D values), grouped-query heads. keys, values: one layer's pages, page p's head h at
 * p * page_stride + h * head_stride elements; q: [R, Hq, D] rows q_row_stride floats apart (more
 * than Hq * D when read in place from a fused QKV projection); out: [R, Hq, D]; lse (optional,
 * [R, Hq]): the log-sum-exp of the scaled scores. One program per (row, KV head): its `group`
 * query heads take each key and value as it is read, so the row's tokens are streamed once. */
static int NAME(attention)(const float *q, int64_t q_row_stride, const ELEMENT *keys, const ELEMENT *values,
                           const int64_t *table, int64_t table_stride, const int64_t *lengths, float *out,
                           float *lse, int64_t R, int64_t Hq, int64_t Hkv, int64_t D, int64_t P,
                           int64_t page_stride, int64_t head_stride, float scale, int threads) {
  const int64_t group = Hq / Hkv;
  int failed = 0;
#pragma omp parallel for schedule(static) reduction(| : failed) num_threads(threads)
  for (int64_t rk = 0; rk < R * Hkv; ++rk) {
    const int64_t r = rk / Hkv, kvh = rk % Hkv;
    const int64_t n = lengths[r] > 0 ? lengths[r] : 0, pages = (n + P - 1) / P;
    const float *qg = q + r * q_row_stride + kvh * group * D; /* the group's heads, [group, D] */
    float *og = out + (r * Hq + kvh * group) * D;
    float *lg = lse ? lse + r * Hq + kvh * group : 0;
    const ELEMENT **kp = malloc((sizeof(ELEMENT *) * 2 + sizeof(int64_t)) * (pages + 1));
    if (!kp) { failed = 1; continue; }
    const ELEMENT **vp = kp + pages + 1;
    int64_t *counts = (int64_t *)(vp + pages + 1);
    for (int64_t i = 0; i < pages; ++i) {
      const int64_t at = table[r * table_stride + i] * page_stride + kvh * head_stride;
      kp[i] = keys + at;
      vp[i] = values + at;
      counts[i] = n - i * P < P ? n - i * P : P;
    }
    failed |= NAME(attend)(qg, kp, vp, counts, pages, n, group, D, scale, og, lg) != 0;
    free(kp);
  }
  return failed ? -1 : 0;
}

int NAME(baton_decode_attention)(const float *q, const ELEMENT *keys, const ELEMENT *values, const int64_t *table,
                                 int64_t table_stride, const int64_t *lengths, float *out, float *lse, int64_t R,
                                 int64_t Hq, int64_t Hkv, int64_t D, int64_t P, int64_t page_stride,
                                 int64_t head_stride, float scale, int threads) {
  return NAME(attention)(q, Hq * D, keys, values, table, table_stride, lengths, out, lse, R, Hq, Hkv, D, P,
                         page_stride, head_stride, scale, threads);
}

/* A prompt's keys or values of one KV head as prefill reads them: the `cached` prefix tokens, then
 * its own; read by tiles in blocks of TILE_BLOCK tokens. Both runs are contiguous, so the hardware's
 * prefetchers follow them: prefetching each next block by hand (as decode does its scattered pages)
 * made an 8,000-token layer 4-5% slower on a Xeon (medians of 10-16 rounds). */
struct NAME(tokens) {
  const ELEMENT *prefix, *own;
  int64_t cached;
};
#define TILE_BLOCK 32
static inline const ELEMENT *NAME(token)(struct NAME(tokens) s, int64_t at, int64_t D) {
  return at < s.cached ? s.prefix + at * D : s.own + (at - s.cached) * D;
}

/* Tokens [from, from + count) as fp32 [count][D], a block that a tile's rows share from L1: fp32
 * tokens of one segment are read where they lie (copying them cost 5% of an 8,000-token prompt's
 * attention), others are widened or joined into buf. */
static inline const float *NAME(block)(vn *buf, struct NAME(tokens) s, int64_t from, int64_t count, int64_t D) {
  if (sizeof(ELEMENT) == sizeof(float) && (from + count <= s.cached || from >= s.cached))
    return (const float *)NAME(token)(s, from, D);
  for (int64_t c = 0; c < count; ++c)
    for (int64_t j = 0; j < D / VW; ++j) buf[c * D / VW + j] = LOADN(NAME(token)(s, from + c, D) + VW * j);
  return (const float *)buf;
}

/* Prefill attention of a tile of up to VW consecutive query tokens of one prompt and KV head (a
 * vector's lanes: 16 with AVX-512), the rows side by side in those lanes: row i (query q + i *
 * q_row_stride, [group, D]; output out + i * Hq * D) attends the first first + i tokens of keys and
 * values. Each row computes what
 * group_attention computes for it alone, operation for operation: each score the same chain of
 * multiply-adds (tile_qk), the same softmax over its own tokens (tile_softmax), the same weighted
 * sum over its tokens in order. Only the reading is shared: each block of keys, then of values, is
 * widened once into L1 and taken by every row of the tile, so the tokens are streamed once per
 * tile instead of once per query token, and each key or value broadcast once feeds VW rows (no
 * key is transposed, no sum shuffled). scratch: group * (2 D + first + rows + TILE_BLOCK) vectors:
 * the queries transposed, the scores, the outputs, 1 / each head's sums, a block's probabilities. */
#define TILE_ATTENTION(NV)                                                                          \
  static NOIPA void NAME(tile_attention_##NV)(const float *q, int64_t q_row_stride, int64_t rows,   \
                                              struct NAME(tokens) keys, struct NAME(tokens) values, \
                                              int64_t first, int64_t group, int64_t Hq, float scale, \
                                              vn *scratch, float *out) {                            \
    const int64_t D = NV * 16, n = first + rows - 1; /* the last row's tokens */                    \
    vn *qt = scratch, *s = scratch + group * D; /* s[x * group + g], lane i: row i, head g, token x */ \
    vn buf[TILE_BLOCK * NV * NH];                                                                   \
    for (int64_t g = 0; g < group; ++g)                                                             \
      for (int64_t d = 0; d < D; ++d)                                                               \
        for (int64_t i = 0; i < VW; ++i) qt[g * D + d][i] = i < rows ? q[i * q_row_stride + g * D + d] : 0.f; \
    for (int64_t block = 0; block < n; block += TILE_BLOCK) {                                       \
      const int64_t count = n - block < TILE_BLOCK ? n - block : TILE_BLOCK;                        \
      const float *k = NAME(block)(buf, keys, block, count, D);                                     \
      for (int64_t t = 0; t < count; t += 8) {                                                      \
        for (int64_t g0 = 0, heads; g0 < group; g0 += heads) {                                      \
          heads = head_chunk(group, g0);                                                            \
          TILE_QKS_##NV[heads](qt + g0 * D, k + t * D, count - t < 8 ? count - t : 8, scale, s + (block + t) * group + g0, group); \
        }                                                                                           \
      }                                                                                             \
    }                                                                                               \
    /* the outputs so far (o[g * D + d], lane i: row i), each head's 1 / sum, a block's probabilities */ \
    vn *o = s + n * group, *inv = o + group * D, *p = inv + group;                                  \
    for (int64_t g = 0; g < group; ++g) inv[g] = tile_softmax(s + g, group, first, n);              \
    for (int64_t i = 0; i < group * D; ++i) o[i] = (vn){0};                                         \
    for (int64_t block = 0; block < n; block += TILE_BLOCK) {                                       \
      const int64_t count = n - block < TILE_BLOCK ? n - block : TILE_BLOCK;                        \
      const float *v = NAME(block)(buf, values, block, count, D);                                   \
      for (int64_t x = 0; x < count; ++x)                                                           \
        for (int64_t g = 0; g < group; ++g) p[x * group + g] = s[(block + x) * group + g] * inv[g]; \
      for (int64_t g0 = 0, heads; g0 < group; g0 += heads) {                                        \
        heads = head_chunk(group, g0);                                                              \
        TILE_PVS[heads](p + g0, group, v, D, count, block, first, o + g0 * D);                     \
      }                                                                                             \
    }                                                                                               \
    for (int64_t g = 0; g < group; ++g)                                                             \
      for (int64_t d = 0; d < D; ++d)                                                               \
        for (int64_t i = 0; i < rows; ++i) out[(i * Hq + g) * D + d] = o[g * D + d][i];             \
  }

TILE_ATTENTION(4)
TILE_ATTENTION(8)
#undef TILE_ATTENTION

/* Prefill attention, each token exactly as a decode step would compute it: B prompts of T new
 * tokens each (query row b * T + t, q_row_stride floats apart, [Hq, D] each), token t seeing the
 * `cached` prefix tokens and its prompt's own tokens [0, t]. own_k, own_v: [B, Hkv, T, D]
 * (own_seq_stride, own_head_stride elements); prefix_k, prefix_v: [Hkv, cached, D] (heads
 * prefix_head_stride apart), shared by every prompt; out: [B * T, Hq, D]. One task per (prompt, KV
 * head, tile of PREFILL_TILE tokens: a vector's lanes), the longest tiles first; head_dim 64 and
 * 128 take the tiled kernel, any other each token through attend. */
#define PREFILL_TILE VW
int NAME(baton_prefill_attention)(const float *q, int64_t q_row_stride, int64_t B, int64_t T, const ELEMENT *own_k,
                                  const ELEMENT *own_v, int64_t own_seq_stride, int64_t own_head_stride,
                                  const ELEMENT *prefix_k, const ELEMENT *prefix_v, int64_t cached,
                                  int64_t prefix_head_stride, float *out, int64_t Hq, int64_t Hkv, int64_t D,
                                  float scale, int threads) {
  const int64_t group = Hq / Hkv, tiles = (T + PREFILL_TILE - 1) / PREFILL_TILE;
  int failed = 0;
#pragma omp parallel reduction(| : failed) num_threads(threads)
  {
    /* One scratch a thread, sized by its first tile (the longest come first): a fresh one a tile
     * was mapped and faulted in again, page by page, whenever the allocator returned it. */
    vn *scratch = 0;
    int64_t held = 0;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tiles * B * Hkv; ++task) {
      const int64_t t0 = (tiles - 1 - task / (B * Hkv)) * PREFILL_TILE, b = task % (B * Hkv) / Hkv, kvh = task % Hkv;
      const int64_t rows = T - t0 < PREFILL_TILE ? T - t0 : PREFILL_TILE, r0 = b * T + t0;
      const struct NAME(tokens) keys = {prefix_k + kvh * prefix_head_stride,
                                        own_k + b * own_seq_stride + kvh * own_head_stride, cached};
      const struct NAME(tokens) values = {prefix_v + kvh * prefix_head_stride,
                                          own_v + b * own_seq_stride + kvh * own_head_stride, cached};
      const float *qt = q + r0 * q_row_stride + kvh * group * D;
      float *ot = out + (r0 * Hq + kvh * group) * D;
      if (D == 64 || D == 128) {
        const int64_t first = cached + t0 + 1, need = group * (2 * D + first + rows + TILE_BLOCK);
        if (need > held) {
          free(scratch);
          scratch = aligned_alloc(sizeof(vn), sizeof(vn) * need);
          held = scratch ? need : 0;
        }
        if (!scratch) { failed = 1; continue; }
        (D == 64 ? NAME(tile_attention_4) : NAME(tile_attention_8))(qt, q_row_stride, rows, keys, values, first,
                                                                     group, Hq, scale, scratch, ot);
        continue;
      }
      for (int64_t i = 0; i < rows; ++i) {
        const ELEMENT *kp[2] = {keys.prefix, keys.own}, *vp[2] = {values.prefix, values.own};
        const int64_t counts[2] = {cached, t0 + i + 1};
        failed |= NAME(attend)(qt + i * q_row_stride, kp, vp, counts, 2, cached + t0 + i + 1, group, D, scale,
                               ot + i * Hq * D, 0) != 0;
      }
    }
    free(scratch);
  }
  return failed ? -1 : 0;
}
#undef PREFILL_TILE
#undef TILE_BLOCK

/* One decode step through every decoder layer of a Llama-family model, in one call: for each
 * layer, RMSNorm, fused QKV (+ bias), rotary on queries and keys, the new keys and values stored
 * into each row's next slot, attention over each row's tokens, the output projection added to the
 * residual, RMSNorm, fused gate/up, SiLU-and-multiply, down projection added to the residual. The
 * same operations, in the same order and with the same kernels, as the per-layer Python path and
 * as prefill; what it saves is ~35 Python-level calls a layer.
 *
 * h: [R, H] fp32, the residual stream, updated in place. weights: per layer 7 addresses (input
 * norm fp32, packed QKV, QKV bias fp32 or 0, packed O, post norm fp32, packed gate/up, packed
 * down), then the formats of QKV, O, gate/up and down (FORMAT_FLOAT: panels of ELEMENT; else
 * quantized panels, quantized.h, plus FORMAT_16_BIT_INPUTS for 16-bit inputs). cos, signed_sin: [R, D] fp32. kv: the paged KV [layers, 2, pages, Hkv, P, D] given by its
 * strides in elements; table: each row's pages (table_stride apart); lengths: each row's tokens,
 * this step's included, which is stored at position lengths[r] - 1. Returns 0, or -1 when out of
 * memory. */
int NAME(baton_decode_layers)(float *h, const int64_t *weights, int64_t L, int64_t R, int64_t H, int64_t Hq,
                              int64_t Hkv, int64_t D, int64_t I, float eps, float scale, const float *cos,
                              const float *signed_sin, ELEMENT *kv, int64_t layer_stride, int64_t kind_stride,
                              int64_t page_stride, int64_t head_stride, int64_t P, const int64_t *table,
                              int64_t table_stride, const int64_t *lengths, int threads) {
  /* scratch for the widest input (the GEMMs' K: H, I, or Hq * D for the output projection, which
   * need not equal H) and the widest output (N: QKV, 2 * I or H) */
  const int64_t QKV = (Hq + 2 * Hkv) * D, K_MAX = max3(H, I, Hq * D), N_MAX = max3(QKV, 2 * I, H);
  float *x = malloc(sizeof(float) * R * K_MAX), *y = malloc(sizeof(float) * R * N_MAX);
  float *attn = malloc(sizeof(float) * R * Hq * D), *xt = malloc(sizeof(float) * R * K_MAX);
  int failed = !x || !y || !attn || !xt;
  for (int64_t l = 0; l < L && !failed; ++l) {
    const int64_t *w = weights + 11 * l, *format = w + 7;
    const float *input_norm = (const float *)w[0], *qkv_bias = (const float *)w[2], *post_norm = (const float *)w[4];
    const void *qkv = (const void *)w[1], *o = (const void *)w[3];
    const void *gate_up = (const void *)w[5], *down = (const void *)w[6];
    ELEMENT *keys = kv + l * layer_stride, *values = keys + kind_stride;

    baton_rms_norm(h, input_norm, x, R, H, eps, threads);
    failed |= NAME(linear)(format[0], x, qkv, y, R, H, QKV, threads, xt);
    if (qkv_bias)
      for (int64_t r = 0; r < R; ++r)
        for (int64_t i = 0; i < QKV; ++i) y[r * QKV + i] += qkv_bias[i];
    baton_rotary(y, R, Hq + Hkv, D, QKV, cos, signed_sin, threads);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t kvh = 0; kvh < Hkv; ++kvh) {
        const int64_t pos = lengths[r] - 1;
        const int64_t at = table[r * table_stride + pos / P] * page_stride + kvh * head_stride + (pos % P) * D;
        const float *k = y + r * QKV + (Hq + kvh) * D, *v = y + r * QKV + (Hq + Hkv + kvh) * D;
        for (int64_t d = 0; d < D; ++d) keys[at + d] = STORE1(k[d]), values[at + d] = STORE1(v[d]);
      }
    failed |= NAME(attention)(y, QKV, keys, values, table, table_stride, lengths, attn, 0, R, Hq, Hkv, D, P,
                             page_stride, head_stride, scale, threads);
    failed |= NAME(linear)(format[1], attn, o, y, R, Hq * D, H, threads, xt);
    for (int64_t i = 0; i < R * H; ++i) h[i] += y[i];

    baton_rms_norm(h, post_norm, x, R, H, eps, threads);
    failed |= NAME(linear)(format[2], x, gate_up, y, R, H, 2 * I, threads, xt);
    baton_silu_mul(y, x, R, I, threads);
    failed |= NAME(linear)(format[3], x, down, y, R, I, H, threads, xt);
    for (int64_t i = 0; i < R * H; ++i) h[i] += y[i];
  }
  free(x), free(y), free(attn), free(xt);
  return failed ? -1 : 0;
}

#undef NAME
#undef LOADN
#undef LOAD1
#undef STORE1
