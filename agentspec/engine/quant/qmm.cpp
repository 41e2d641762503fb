// agentspec's CPU products over quantized weights, as a GGUF file stores them.
//
// A weight of N output rows and K inputs is held in tiles of 64 output rows (zero-padded),
// each tile in groups of GS inputs (GS = 32, or 16 for Q6_K): per group the quantized values
// ([GS][64] bytes, or [GS/2][64] bytes holding two 4-bit values each: input k in the low
// nibble, input k + GS/2 in the high one), a scale and an offset per output row. The weight is
// w = fma(scale, q, offset), the value gguf's own dequantisation gives (its product d * q is
// exact in float32, so one rounding either way).
//
// Row invariance by construction: out[m][n] = fma(x[m][K-1], w[n][K-1], ... fma(x[m][0],
// w[n][0], 0)), one chain in the order of k, whatever M is, whichever of the forward's rows m
// is, and whichever thread computes the tile. Threads split the output rows (tiles), never K.
// A tile's groups are dequantised once into a small buffer and used by every row, so eight
// rows cost far less than eight times one.
//
// Both fmas are correctly rounded (the AVX-512 instructions and fmaf alike), so the portable
// path gives the same bits as the vector one.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define AS_AVX512 1
#endif

static inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400u)) { man <<= 1; exp--; }
      man &= 0x3ffu;
      bits = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

// The scales or offsets of one group's 64 output rows as floats.
static inline void load_params(const void* p, int f32, int64_t at, float* out) {
  if (f32) {
    memcpy(out, (const float*)p + at, 64 * sizeof(float));
    return;
  }
  const uint16_t* h = (const uint16_t*)p + at;
#ifdef AS_AVX512
  for (int c = 0; c < 4; c++)
    _mm512_storeu_ps(out + 16 * c, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(h + 16 * c))));
#else
  for (int c = 0; c < 64; c++) out[c] = half_to_float(h[c]);
#endif
}

static inline int64_t group_bytes(int bits, int gs) {
  return bits == 4 ? (int64_t)(gs / 2) * 64 : (int64_t)gs * 64;
}

// Stores rows [m0, m0 + rows) of the unit's 32 output columns (acc: [rows][32]): out[m][n] =
// add[m][n] + (acc + bias[n]), rows ldo apart (bias and add optional; add may be out).
static inline void store(const float* acc, int64_t rows, int64_t m0, int64_t N, int64_t n0,
                         const float* bias, const float* add, float* out, int64_t ldo) {
  int64_t width = N - n0 < 32 ? N - n0 : 32;
  for (int64_t r = 0; r < rows; r++) {
    float* row = out + (m0 + r) * ldo + n0;
    const float* plus = add ? add + (m0 + r) * ldo + n0 : nullptr;
    for (int64_t c = 0; c < width; c++) {
      float v = acc[r * 32 + c];
      if (bias) v = v + bias[n0 + c];
      row[c] = plus ? plus[c] + v : v;
    }
  }
}

#ifdef AS_AVX512
// The weights of input k of one group, for the unit's 32 output columns (two vectors).
static inline void weights2(const uint8_t* base, int bits, int gs, int k, int half,
                            const __m512* sc, const __m512* of, __m512* w) {
  __m128i raw[2];
  if (bits == 4) {
    int h = gs / 2;
    __m256i v = _mm256_loadu_si256((const __m256i*)(base + (k % h) * 64 + half * 32));
    if (k >= h) v = _mm256_srli_epi16(v, 4);
    v = _mm256_and_si256(v, _mm256_set1_epi8(0x0f));
    raw[0] = _mm256_castsi256_si128(v);
    raw[1] = _mm256_extracti128_si256(v, 1);
    for (int c = 0; c < 2; c++)
      w[c] = _mm512_fmadd_ps(sc[c], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(raw[c])), of[c]);
  } else {
    const int8_t* row = (const int8_t*)base + k * 64 + half * 32;
    for (int c = 0; c < 2; c++)
      w[c] = _mm512_fmadd_ps(sc[c], _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                        _mm_loadu_si128((const __m128i*)(row + 16 * c)))), of[c]);
  }
}

static inline void params2(const void* p, int f32, int64_t at, __m512* out) {
  for (int c = 0; c < 2; c++) {
    if (!p) out[c] = _mm512_setzero_ps();
    else if (f32) out[c] = _mm512_loadu_ps((const float*)p + at + 16 * c);
    else out[c] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)p + at + 16 * c)));
  }
}

// Rows [m0, m0 + R) of one unit (tile t, 32 columns at half): each weight dequantised in
// registers once for the R rows, each (row, column) one fma chain over k in order.
template <int R>
static void rows_direct(const float* x, int64_t K, int64_t m0, const uint8_t* q, int bits,
                        int gs, int64_t groups, int64_t t, int half, const void* scale,
                        const void* offset, int f32, float* acc) {
  __m512 a[R][2];
  for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    int64_t at = (t * groups + g) * 64 + half * 32;
    __m512 sc[2], of[2], w[2];
    params2(scale, f32, at, sc);
    params2(offset, f32, at, of);
    const uint8_t* base = q + (t * groups + g) * group_bytes(bits, gs);
    const float* xg = x + m0 * K + g * gs;
    for (int k = 0; k < gs; k++) {
      weights2(base, bits, gs, k, half, sc, of, w);
      for (int r = 0; r < R; r++) {
        __m512 xb = _mm512_set1_ps(xg[r * K + k]);
        a[r][0] = _mm512_fmadd_ps(xb, w[0], a[r][0]);
        a[r][1] = _mm512_fmadd_ps(xb, w[1], a[r][1]);
      }
    }
  }
  for (int r = 0; r < R; r++) {
    _mm512_storeu_ps(acc + r * 32, a[r][0]);
    _mm512_storeu_ps(acc + r * 32 + 16, a[r][1]);
  }
}

typedef void (*direct_fn)(const float*, int64_t, int64_t, const uint8_t*, int, int, int64_t,
                          int64_t, int, const void*, const void*, int, float*);
static const direct_fn DIRECT[9] = {nullptr, rows_direct<1>, rows_direct<2>, rows_direct<3>,
                                    rows_direct<4>, rows_direct<5>, rows_direct<6>,
                                    rows_direct<7>, rows_direct<8>};

// All M rows of one unit, many rows: each group's weights dequantised once into buf[gs][32],
// then the rows' chains continued from acc[M][32], eight rows at a time (the same chains).
static void rows_buffered(const float* x, int64_t K, int64_t M, const uint8_t* q, int bits,
                          int gs, int64_t groups, int64_t t, int half, const void* scale,
                          const void* offset, int f32, float* buf, float* acc) {
  memset(acc, 0, (size_t)M * 32 * sizeof(float));
  for (int64_t g = 0; g < groups; g++) {
    int64_t at = (t * groups + g) * 64 + half * 32;
    __m512 sc[2], of[2], w[2];
    params2(scale, f32, at, sc);
    params2(offset, f32, at, of);
    const uint8_t* base = q + (t * groups + g) * group_bytes(bits, gs);
    for (int k = 0; k < gs; k++) {
      weights2(base, bits, gs, k, half, sc, of, w);
      _mm512_storeu_ps(buf + k * 32, w[0]);
      _mm512_storeu_ps(buf + k * 32 + 16, w[1]);
    }
    const float* xg = x + g * gs;
    int64_t m = 0;
    for (; m + 8 <= M; m += 8) {
      __m512 a[8][2];
      for (int r = 0; r < 8; r++) {
        a[r][0] = _mm512_loadu_ps(acc + (m + r) * 32);
        a[r][1] = _mm512_loadu_ps(acc + (m + r) * 32 + 16);
      }
      for (int k = 0; k < gs; k++) {
        __m512 w0 = _mm512_loadu_ps(buf + k * 32), w1 = _mm512_loadu_ps(buf + k * 32 + 16);
        for (int r = 0; r < 8; r++) {
          __m512 xb = _mm512_set1_ps(xg[(m + r) * K + k]);
          a[r][0] = _mm512_fmadd_ps(xb, w0, a[r][0]);
          a[r][1] = _mm512_fmadd_ps(xb, w1, a[r][1]);
        }
      }
      for (int r = 0; r < 8; r++) {
        _mm512_storeu_ps(acc + (m + r) * 32, a[r][0]);
        _mm512_storeu_ps(acc + (m + r) * 32 + 16, a[r][1]);
      }
    }
    for (; m < M; m++) {
      __m512 a0 = _mm512_loadu_ps(acc + m * 32), a1 = _mm512_loadu_ps(acc + m * 32 + 16);
      for (int k = 0; k < gs; k++) {
        __m512 xb = _mm512_set1_ps(xg[m * K + k]);
        a0 = _mm512_fmadd_ps(xb, _mm512_loadu_ps(buf + k * 32), a0);
        a1 = _mm512_fmadd_ps(xb, _mm512_loadu_ps(buf + k * 32 + 16), a1);
      }
      _mm512_storeu_ps(acc + m * 32, a0);
      _mm512_storeu_ps(acc + m * 32 + 16, a1);
    }
  }
}
#endif

// The weight of output column n (of 64 in tile t) and input k, as gguf dequantises it.
static inline float weight_at(const uint8_t* q, int bits, int gs, int64_t groups, int64_t t,
                              int64_t g, int k, int n, const void* scale, const void* offset,
                              int f32) {
  int64_t at = (t * groups + g) * 64 + n;
  float s = f32 ? ((const float*)scale)[at] : half_to_float(((const uint16_t*)scale)[at]);
  float o = !offset ? 0.0f : f32 ? ((const float*)offset)[at]
                                 : half_to_float(((const uint16_t*)offset)[at]);
  const uint8_t* base = q + (t * groups + g) * group_bytes(bits, gs);
  float v;
  if (bits == 4) {
    int h = gs / 2;
    uint8_t b = base[(k % h) * 64 + n];
    v = (float)(k >= h ? b >> 4 : b & 0x0f);
  } else {
    v = (float)((const int8_t*)base)[k * 64 + n];
  }
  return fmaf(s, v, o);
}

// Rows of one unit, portably (the same weights, the same chains, slower).
static void rows_portable(const float* x, int64_t K, int64_t M, const uint8_t* q, int bits,
                          int gs, int64_t groups, int64_t t, int half, const void* scale,
                          const void* offset, int f32, float* acc) {
  for (int64_t m = 0; m < M; m++)
    for (int c = 0; c < 32; c++) {
      float a = 0.0f;
      for (int64_t g = 0; g < groups; g++)
        for (int k = 0; k < gs; k++)
          a = fmaf(x[m * K + g * gs + k],
                   weight_at(q, bits, gs, groups, t, g, k, half * 32 + c, scale, offset, f32), a);
      acc[m * 32 + c] = a;
    }
}

// out[m][n] = add[m][n] + (x[M][K] @ W^T + bias)[m][n], output rows ldo apart (bias, add
// optional), W quantized as above; nthreads threads share the units of 32 output columns (half
// a tile each), never K.
void as_qmm_into(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* q, int bits,
                 int gs, const void* scale, const void* offset, int f32, const float* bias,
                 const float* add, float* out, int64_t ldo, int nthreads) {
  int64_t tiles = (N + 63) / 64, groups = K / gs, units = 2 * tiles;
#pragma omp parallel num_threads(nthreads)
  {
    float* acc = (float*)aligned_alloc(64, (size_t)(M < 8 ? 8 : M) * 32 * sizeof(float));
    float* buf = (float*)aligned_alloc(64, (size_t)gs * 32 * sizeof(float));
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; u++) {
      int64_t t = u / 2, n0 = u * 32;
      int half = (int)(u % 2);
      if (n0 >= N) continue;
#ifdef AS_AVX512
      if (M < 16) {
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
          int64_t rows = M - m0 < 8 ? M - m0 : 8;
          DIRECT[rows](x, K, m0, q, bits, gs, groups, t, half, scale, offset, f32, acc);
          store(acc, rows, m0, N, n0, bias, add, out, ldo);
        }
        continue;
      }
      rows_buffered(x, K, M, q, bits, gs, groups, t, half, scale, offset, f32, buf, acc);
#else
      rows_portable(x, K, M, q, bits, gs, groups, t, half, scale, offset, f32, acc);
#endif
      store(acc, M, 0, N, n0, bias, add, out, ldo);
    }
    free(acc);
    free(buf);
  }
}

// out[M][N] = x[M][K] @ W^T (+ bias[N] when given).
extern "C" void as_qmm(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* q,
                       int bits, int gs, const void* scale, const void* offset, int f32,
                       const float* bias, float* out, int nthreads) {
  as_qmm_into(x, M, K, N, q, bits, gs, scale, offset, f32, bias, nullptr, out, N, nthreads);
}

// Rows ids[i] of the weight (an embedding table held as above) into out[len(ids)][K].
extern "C" void as_qrows(const int64_t* ids, int64_t count, int64_t K, const uint8_t* q,
                         int bits, int gs, const void* scale, const void* offset, int f32,
                         float* out) {
  int64_t groups = K / gs;
  for (int64_t i = 0; i < count; i++) {
    int64_t t = ids[i] / 64;
    int n = (int)(ids[i] % 64);
    for (int64_t g = 0; g < groups; g++)
      for (int k = 0; k < gs; k++)
        out[i * K + g * gs + k] = weight_at(q, bits, gs, groups, t, g, k, n, scale, offset, f32);
  }
}
