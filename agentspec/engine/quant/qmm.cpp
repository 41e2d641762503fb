// agentspec's CPU products over quantized weights, as a GGUF file stores them.
//
// Weights. A weight of N output rows and K inputs is held in units of 32 output rows (tiles of
// 64 zero-padded, two units each), each unit in groups of GS inputs (GS = 32, or 16 for Q6_K):
// the quantized values q, then a scale and an offset per output row and group. The weight is
// w = fma(scale, q, offset), the value gguf's own dequantisation gives. A unit is two blocks of
// 16 output rows, each block its groups in order, a group a run of 32-byte chunks that widen to
// the lanes of the dot-product instruction: lane c holds two consecutive inputs of output row c.
// 8-bit formats (q signed, in a byte): chunk j holds inputs 2j, 2j + 1. 4-bit formats (q
// 0..15): chunk j holds inputs 4j, 4j + 1 in its low nibbles and 4j + 2, 4j + 3 in its high
// ones. 5- and 6-bit formats (Q5_x, Q5_K: 0..31; Q6_K: -32..31, held as q + 32): the 4-bit
// chunk of the values' low nibbles, then per high bit an 8-byte plane, bit 2c + i of its first
// four bytes that bit of row c's input 4j + i, of the next four of input 4j + 2 + i; the
// products widen the nibbles and OR the planes' bits in (less 32). The scales and offsets
// (params: 0 float16, 1 float32) are [unit][group][32]; a K-quant's (params 2) per unit the
// float16 d of each 256 inputs ([supers][32]), then the int8 sc of each group ([groups][32]):
// the scale is d * sc, exact in float32 (the offset alike).
// A weight whose offsets are all +0 (Q8_0, Q6_K) holds none (a null pointer).
//
// bfloat16 weights (bits 16: a float checkpoint held in bfloat16, no scales): per unit and
// block the K / 2 pairs of inputs in order, each a run of 16 32-bit lanes, lane c holding
// output row c's inputs 2i (low half) and 2i + 1 (high half). Their products take the input
// rows in float32 as they are: per (row, output) two fma chains, over the even inputs and the
// odd ones in order (a lane's halves widen exactly: a shift, a mask), added at the end.
//
// Activations. A product's input rows are quantized first, each row alone: per group of 32
// inputs d = amax / 32767 and x_q = round(x * (32767 / amax)), 16-bit, with the sums of x_q
// per 16 inputs. Then per (row, output, group) the integer sum S = sum(q * x_q) is exact, and
// the group adds ((scale * S) + (offset * sum(x_q))) * d to the row's float32 accumulator,
// groups in order of k, each operation rounded once. 16 bits keep the products within float32
// summation noise of the dequantised weights' (8-bit activations, llama.cpp's, would not on
// the packaged model). So a row's bits depend on its own inputs only, whatever M is, whichever
// row of the call it is and whichever thread computes its unit (threads split units, never K);
// and the vector paths (vec.h: 16 lanes on AVX-512, 8 on AVX2, 4 on NEON) and the portable
// one give the same bits: integer sums are exact and the float operations the same, in the same order.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include <type_traits>

#include "vec.h"

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

// Where unit u's factored params start (params 2).
static inline const uint8_t* factored_at(const void* p, int64_t u, int64_t groups, int gs) {
  int64_t supers = groups * gs / 256;
  return (const uint8_t*)p + u * (supers * 64 + groups * 32);
}

// The scale (or offset) of output row c of unit u, group g.
static inline float param_at(const void* p, int params, int64_t u, int64_t g, int c,
                             int64_t groups, int gs) {
  if (!p) return 0.0f;  // no offsets: all +0
  if (params == 2) {
    const uint8_t* base = factored_at(p, u, groups, gs);
    uint16_t d;
    memcpy(&d, base + (g * gs / 256) * 64 + 2 * c, 2);
    int64_t supers = groups * gs / 256;
    return half_to_float(d) * (float)(int8_t)base[supers * 64 + g * 32 + c];
  }
  int64_t at = (u * groups + g) * 32 + c;
  return params ? ((const float*)p)[at] : half_to_float(((const uint16_t*)p)[at]);
}

// Bytes of one block's chunk of four inputs (bits 4 to 6: 32 of low nibbles, 8 a high bit's
// plane), and of one block's group of values (16 output rows).
static inline int64_t chunk_bytes(int bits) { return 32 + 8 * (bits - 4); }
static inline int64_t block_bytes(int bits, int gs) {
  return bits == 8 ? 16 * gs : chunk_bytes(bits) * (gs / 4);
}

// The values of unit u's block b (16 output rows), group g.
static inline const uint8_t* block_at(const uint8_t* q, int bits, int gs, int64_t groups,
                                      int64_t u, int b, int64_t g) {
  return q + ((u * 2 + b) * groups + g) * block_bytes(bits, gs);
}

// The quantized value q of output row c (of the unit's 32) and input k (of group g).
static inline int stored_at(const uint8_t* q, int bits, int gs, int64_t groups, int64_t u,
                            int64_t g, int k, int c) {
  const uint8_t* block = block_at(q, bits, gs, groups, u, c / 16, g);
  if (bits == 8) return (int8_t)block[(k / 2) * 32 + (c % 16) * 2 + k % 2];
  const uint8_t* chunk = block + (k / 4) * chunk_bytes(bits);
  int lane = (c % 16) * 2 + k % 2, pair = (k % 4) / 2;
  int v = pair ? chunk[lane] >> 4 : chunk[lane] & 0x0f;
  for (int p = 0; p < bits - 4; p++)
    v |= ((chunk[32 + 8 * p + 4 * pair + lane / 8] >> (lane % 8)) & 1) << (4 + p);
  return bits == 6 ? v - 32 : v;
}

// Input rows quantized per group of 32 (see the top of this file).
struct QX {
  const int16_t* q;     // [M][K]
  const float* d;       // [M][K / 32]
  const int32_t* sums;  // [M][K / 16]
  int64_t K;
};

static void quantize_row(const float* x, int64_t K, int16_t* q, float* d, int32_t* sums) {
  for (int64_t g = 0; g < K / 32; g++) {
    const float* xg = x + g * 32;
#ifdef AS_AVX512
    __m512 a0 = _mm512_abs_ps(_mm512_loadu_ps(xg)), a1 = _mm512_abs_ps(_mm512_loadu_ps(xg + 16));
    float amax = _mm512_reduce_max_ps(_mm512_max_ps(a0, a1));
    float id = amax > 0.0f ? 32767.0f / amax : 0.0f;
    for (int h = 0; h < 2; h++) {  // cvtps rounds to nearest even, as nearbyintf does
      __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xg + 16 * h), _mm512_set1_ps(id)));
      _mm256_storeu_si256((__m256i*)(q + g * 32 + 16 * h), _mm512_cvtsepi32_epi16(v));
      sums[g * 2 + h] = _mm512_reduce_add_epi32(v);
    }
#else
    float amax = 0.0f;
    for (int i = 0; i < 32; i++) amax = fmaxf(amax, fabsf(xg[i]));
    float id = amax > 0.0f ? 32767.0f / amax : 0.0f;
    for (int h = 0; h < 2; h++) {
      int32_t s = 0;
      for (int i = 16 * h; i < 16 * h + 16; i++) {
        int v = (int)nearbyintf(xg[i] * id);
        q[g * 32 + i] = (int16_t)v;
        s += v;
      }
      sums[g * 2 + h] = s;
    }
#endif
    d[g] = amax / 32767.0f;
  }
}

// M rows of K inputs (ldx apart) quantized into one allocation (free(qx.q) releases it).
static QX quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int nthreads) {
  size_t qb = (size_t)M * K * 2, db = (size_t)M * (K / 32) * 4, sb = (size_t)M * (K / 16) * 4;
  char* mem = (char*)malloc(qb + db + sb + 64);
  QX qx;
  qx.q = (int16_t*)mem;
  qx.d = (float*)(mem + ((qb + 15) / 16) * 16);
  qx.sums = (int32_t*)((char*)qx.d + db);
  qx.K = K;
#pragma omp parallel for num_threads(nthreads) if (M > 8) schedule(static)
  for (int64_t m = 0; m < M; m++)
    quantize_row(x + m * ldx, K, (int16_t*)qx.q + m * K, (float*)qx.d + m * (K / 32),
                 (int32_t*)qx.sums + m * (K / 16));
  return qx;
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

// The integer sum of x_q over weight group g (gs inputs) of row m.
static inline int32_t group_sum(const QX& x, int64_t m, int gs, int64_t g) {
  const int32_t* s = x.sums + m * (x.K / 16);
  return gs == 16 ? s[g] : s[2 * g] + s[2 * g + 1];
}

#ifdef AS_VEC
// The scales (or offsets) of unit u's output rows [lane0, lane0 + LANES), group g.
static inline vf params_v(const void* p, int params, int64_t u, int lane0, int64_t g,
                          int64_t groups, int gs) {
  if (!p) return vf_zero();  // no offsets: all +0
  if (params == 2) {
    const uint8_t* base = factored_at(p, u, groups, gs);
    int64_t supers = groups * gs / 256;
    vf d = vf_half((const uint16_t*)(base + (g * gs / 256) * 64) + lane0);
    return vf_mul(d, vi_float(vi_int8((const int8_t*)base + supers * 64 + g * 32 + lane0)));
  }
  int64_t at = (u * groups + g) * 32 + lane0;
  if (params) return vf_load((const float*)p + at);
  return vf_half((const uint16_t*)p + at);
}

// Groups ahead whose values a pass of several rows asks the cache for before it reads them:
// at a few rows a product streams its weights from memory while it computes, and the
// hardware's prefetcher alone leaves it waiting (at one row the product is the memory's
// speed either way, and asking changes nothing). A prefetch changes no bits.
static const int PREFETCH_GROUPS = 8;

// Rows [m0, m0 + R) of unit u, output rows [lane0, lane0 + LANES): per group the R rows'
// integer sums in registers (pairwise products of the widened chunks, exact), then the
// group's float step.
template <int R, int BITS>
static void lanes_rows(const QX& x, int64_t m0, const uint8_t* q, int gs, int64_t groups,
                       int64_t u, int lane0, const void* scale, const void* offset, int params,
                       float* acc) {
  vf a[R];
  for (int r = 0; r < R; r++) a[r] = vf_zero();
  for (int64_t g = 0; g < groups; g++) {
    // lane c's two bytes of a 32-byte chunk are at 2 * (c % 16), its bits of a plane's four
    // bytes at 2 * (c % 16)
    const uint8_t* w = block_at(q, BITS, gs, groups, u, lane0 / 16, g);
    if constexpr (R >= 4) {  // the values PREFETCH_GROUPS on (the next block's, past the end)
      const int64_t bytes = block_bytes(BITS, gs);
      for (int64_t o = 0; o < bytes; o += 64)
        __builtin_prefetch(w + PREFETCH_GROUPS * bytes + o, 0, 3);
    }
    vi s[R];
    for (int r = 0; r < R; r++) s[r] = vi_zero();
    const int16_t* xg = x.q + m0 * x.K + g * gs;
    if (BITS != 8) {
      for (int j = 0; j < gs / 4; j++) {
        const uint8_t* c = w + chunk_bytes(BITS) * j;
        vi lo, hi;
        vi_nibbles(c + (lane0 % 16) * 2, lo, hi);
        for (int p = 0; p < BITS - 4; p++) {  // the high bits, planes after the nibbles
          const uint8_t* plane = c + 32 + 8 * p + (lane0 % 16) / 4;
          lo = vi_or(lo, vi_bits16(plane, (int16_t)(16 << p)));
          hi = vi_or(hi, vi_bits16(plane + 4, (int16_t)(16 << p)));
        }
        if (BITS == 6) lo = vi_sub16(lo, 32), hi = vi_sub16(hi, 32);  // held as q + 32
        for (int r = 0; r < R; r++) {
          s[r] = vi_dot(s[r], lo, vi_pair(xg + r * x.K, 2 * j));
          s[r] = vi_dot(s[r], hi, vi_pair(xg + r * x.K, 2 * j + 1));
        }
      }
    } else {
      for (int j = 0; j < gs / 2; j++) {
        vi v = vi_bytes(w + 32 * j + (lane0 % 16) * 2);
        for (int r = 0; r < R; r++) s[r] = vi_dot(s[r], v, vi_pair(xg + r * x.K, j));
      }
    }
    vf sc = params_v(scale, params, u, lane0, g, groups, gs);
    vf of = params_v(offset, params, u, lane0, g, groups, gs);
    for (int r = 0; r < R; r++) {
      float xs = (float)group_sum(x, m0 + r, gs, g);
      vf v = vf_mul(sc, vi_float(s[r]));
      v = vf_add(v, vf_mul(of, vf_set(xs)));
      v = vf_mul(v, vf_set(x.d[(m0 + r) * (x.K / 32) + (g * gs) / 32]));
      a[r] = vf_add(a[r], v);
    }
  }
  for (int r = 0; r < R; r++) vf_store(acc + r * 32 + lane0, a[r]);
}

// R rows of a unit's 32 outputs in passes: each LANES outputs, PASS_ROWS rows a pass (the
// rest in one more), as pass(rows, r, lane0) with rows a compile-time count.
template <int R, typename Pass>
static inline void in_passes(Pass pass) {
  for (int lane0 = 0; lane0 < 32; lane0 += LANES) {
    int r = 0;
    for (; r + PASS_ROWS <= R; r += PASS_ROWS)
      pass(std::integral_constant<int, PASS_ROWS>(), r, lane0);
    if constexpr (R % PASS_ROWS != 0) pass(std::integral_constant<int, R % PASS_ROWS>(), r, lane0);
  }
}

// Rows [m0, m0 + R) of unit u.
template <int R, int BITS>
static void unit_rows(const QX& x, int64_t m0, const uint8_t* q, int gs, int64_t groups,
                      int64_t u, const void* scale, const void* offset, int params, float* acc) {
  in_passes<R>([&](auto rows, int r, int lane0) {
    lanes_rows<decltype(rows)::value, BITS>(x, m0 + r, q, gs, groups, u, lane0, scale, offset,
                                            params, acc + r * 32);
  });
}

typedef void (*unit_fn)(const QX&, int64_t, const uint8_t*, int, int64_t, int64_t, const void*,
                        const void*, int, float*);
#define AS_UNITS(B)                                                                         \
  {nullptr, unit_rows<1, B>, unit_rows<2, B>, unit_rows<3, B>, unit_rows<4, B>,              \
   unit_rows<5, B>, unit_rows<6, B>, unit_rows<7, B>, unit_rows<8, B>}
static const unit_fn UNITS[4][9] = {AS_UNITS(4), AS_UNITS(5), AS_UNITS(6), AS_UNITS(8)};
#endif

// Rows [m0, m0 + rows) of unit u, portably (the same sums and float steps, slower).
static void unit_portable(const QX& x, int64_t m0, int64_t rows, const uint8_t* q, int bits,
                          int gs, int64_t groups, int64_t u, const void* scale,
                          const void* offset, int params, float* acc) {
  for (int64_t r = 0; r < rows; r++)
    for (int c = 0; c < 32; c++) {
      float a = 0.0f;
      for (int64_t g = 0; g < groups; g++) {
        const int16_t* xg = x.q + (m0 + r) * x.K + g * gs;
        int32_t s = 0;
        for (int k = 0; k < gs; k++)
          s += stored_at(q, bits, gs, groups, u, g, k, c) * (int32_t)xg[k];
        float xs = (float)group_sum(x, m0 + r, gs, g);
        float v = param_at(scale, params, u, g, c, groups, gs) * (float)s;
        v = v + param_at(offset, params, u, g, c, groups, gs) * xs;
        v = v * x.d[(m0 + r) * (x.K / 32) + (g * gs) / 32];
        a = a + v;
      }
      acc[r * 32 + c] = a;
    }
}

static inline float bf16_to_float(uint16_t h) {
  uint32_t bits = (uint32_t)h << 16;
  float out;
  memcpy(&out, &bits, 4);
  return out;
}

// The bfloat16 weight of output row c (of unit u's 32) and input k.
static inline float bf16_at(const uint8_t* q, int64_t K, int64_t u, int c, int64_t k) {
  uint16_t h;
  memcpy(&h, q + ((((u * 2 + c / 16) * (K / 2) + k / 2) * 16 + c % 16) * 4 + (k % 2) * 2), 2);
  return bf16_to_float(h);
}

#ifdef AS_VEC
// Rows [m0, m0 + R) (x: float rows ldx apart) of a bfloat16 weight's unit u, output rows
// [lane0, lane0 + LANES): per row the even and odd inputs' fma chains in registers.
template <int R>
static void lanes_bf16(const float* x, int64_t ldx, int64_t m0, const uint8_t* q, int64_t K,
                       int64_t u, int lane0, float* acc) {
  const vi high = vi_set((int32_t)0xffff0000u);
  // lane c's 4 bytes of a 64-byte run are at 4 * (c % 16)
  const uint8_t* w = q + (u * 2 + lane0 / 16) * (K / 2) * 64 + (lane0 % 16) * 4;
  vf e[R], o[R];
  for (int r = 0; r < R; r++) e[r] = o[r] = vf_zero();
  for (int64_t i = 0; i < K / 2; i++) {
    vi v = vi_load(w + i * 64);
    vf lo = vf_bits(vi_shl(v, 16)), hi = vf_bits(vi_and(v, high));
    for (int r = 0; r < R; r++) {
      const float* xr = x + (m0 + r) * ldx + 2 * i;
      e[r] = vf_fma(lo, vf_set(xr[0]), e[r]);
      o[r] = vf_fma(hi, vf_set(xr[1]), o[r]);
    }
  }
  for (int r = 0; r < R; r++) vf_store(acc + r * 32 + lane0, vf_add(e[r], o[r]));
}

// Rows [m0, m0 + R) of a bfloat16 weight's unit u.
template <int R>
static void unit_bf16(const float* x, int64_t ldx, int64_t m0, const uint8_t* q, int64_t K,
                      int64_t u, float* acc) {
  in_passes<R>([&](auto rows, int r, int lane0) {
    lanes_bf16<decltype(rows)::value>(x, ldx, m0 + r, q, K, u, lane0, acc + r * 32);
  });
}

typedef void (*bf16_fn)(const float*, int64_t, int64_t, const uint8_t*, int64_t, int64_t, float*);
static const bf16_fn UNITS16[9] = {nullptr, unit_bf16<1>, unit_bf16<2>, unit_bf16<3>, unit_bf16<4>,
                                   unit_bf16<5>, unit_bf16<6>, unit_bf16<7>, unit_bf16<8>};
#endif

// The same, portably (the same fma chains, one output at a time).
static void unit_bf16_portable(const float* x, int64_t ldx, int64_t m0, int64_t rows,
                               const uint8_t* q, int64_t K, int64_t u, float* acc) {
  for (int64_t r = 0; r < rows; r++)
    for (int c = 0; c < 32; c++) {
      const float* xr = x + (m0 + r) * ldx;
      float e = 0.0f, o = 0.0f;
      for (int64_t i = 0; i < K / 2; i++) {
        e = fmaf(bf16_at(q, K, u, c, 2 * i), xr[2 * i], e);
        o = fmaf(bf16_at(q, K, u, c, 2 * i + 1), xr[2 * i + 1], o);
      }
      acc[r * 32 + c] = e + o;
    }
}

// One weight of a products() call (held as above: bits 16 bfloat16, else quantized) and where
// its outputs go: out[m][n] = add[m][n] + (x @ W^T + bias)[m][n], output rows ldo apart (bias,
// add optional; add may be out).
struct Job {
  int64_t N;
  const uint8_t* q;
  int bits, gs, params;
  const void* scale;
  const void* offset;
  const float* bias;
  const float* add;
  float* out;
  int64_t ldo;
};

// Each unit of 32 outputs of each job (a job's units: 2 * ceil(N / 64)), eight rows at a time by
// `unit(job, u, m0, rows, acc)` into acc [rows][32], then stored; nthreads threads share the
// jobs' units as one list in one parallel region (never K), so the products of one input (a
// layer's query, key and value; its gate and up) cost one fork and join and split evenly.
template <typename Unit>
static void each_unit(int64_t M, const Job* jobs, int count, int nthreads, Unit unit) {
  int64_t first[9] = {0};
  for (int j = 0; j < count; j++) first[j + 1] = first[j] + 2 * ((jobs[j].N + 63) / 64);
#pragma omp parallel num_threads(nthreads)
  {
    float acc[8 * 32];
#pragma omp for schedule(static)
    for (int64_t i = 0; i < first[count]; i++) {
      int j = 0;
      while (i >= first[j + 1]) j++;
      const Job& w = jobs[j];
      int64_t u = i - first[j], n0 = u * 32;
      if (n0 >= w.N) continue;
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        int64_t rows = M - m0 < 8 ? M - m0 : 8;
        unit(w, u, m0, rows, acc);
        store(acc, rows, m0, w.N, n0, w.bias, w.add, w.out, w.ldo);
      }
    }
  }
}

// A product's input rows (M rows of K floats, K apart), quantized at most once, when a product
// over quantized weights first takes them: rows several products read are quantized once, and
// a bfloat16 weight's products take them as they are.
struct Rows {
  const float* x;
  int64_t rows, K;
  int nthreads;
  QX q;
  bool made;
  Rows(const float* x_, int64_t rows_, int64_t K_, int nthreads_)
      : x(x_), rows(rows_), K(K_), nthreads(nthreads_), q(), made(false) {}
  Rows(const Rows&) = delete;
  Rows& operator=(const Rows&) = delete;
  const QX& quantized() {
    if (!made) q = quantize_rows(x, rows, K, K, nthreads), made = true;
    return q;
  }
  ~Rows() {
    if (made) free((void*)q.q);
  }
};

// The jobs' products (at most 8) of the rows x: a bfloat16 weight's over the rows as they are, a
// quantized one's over the rows quantized.
static void products(Rows& x, const Job* jobs, int count) {
  const QX* qx = nullptr;
  for (int j = 0; j < count; j++)
    if (jobs[j].bits != 16) qx = &x.quantized();  // before the threads share it
  each_unit(x.rows, jobs, count, x.nthreads,
            [&](const Job& w, int64_t u, int64_t m0, int64_t rows, float* acc) {
              if (w.bits == 16) {
#ifdef AS_VEC
                UNITS16[rows](x.x, x.K, m0, w.q, x.K, u, acc);
#else
                unit_bf16_portable(x.x, x.K, m0, rows, w.q, x.K, u, acc);
#endif
                return;
              }
              int64_t groups = x.K / w.gs;
#ifdef AS_VEC
              UNITS[w.bits == 8 ? 3 : w.bits - 4][rows](*qx, m0, w.q, w.gs, groups, u, w.scale,
                                                         w.offset, w.params, acc);
#else
              unit_portable(*qx, m0, rows, w.q, w.bits, w.gs, groups, u, w.scale, w.offset,
                            w.params, acc);
#endif
            });
}

// out[M][N] = x[M][K] @ W^T (+ bias[N] when given).
extern "C" void as_qmm(const float* x, int64_t M, int64_t K, int64_t N, const uint8_t* q,
                       int bits, int gs, const void* scale, const void* offset, int params,
                       const float* bias, float* out, int nthreads) {
  Rows in(x, M, K, nthreads);
  Job job = {N, q, bits, gs, params, scale, offset, bias, nullptr, out, N};
  products(in, &job, 1);
}

// Rows ids[i] of the weight (an embedding table held as above), dequantised as gguf does (a
// bfloat16 one widened), into out[len(ids)][K].
extern "C" void as_qrows(const int64_t* ids, int64_t count, int64_t K, const uint8_t* q,
                         int bits, int gs, const void* scale, const void* offset, int params,
                         float* out) {
  if (bits == 16) {
    for (int64_t i = 0; i < count; i++)
      for (int64_t k = 0; k < K; k++) out[i * K + k] = bf16_at(q, K, ids[i] / 32, (int)(ids[i] % 32), k);
    return;
  }
  int64_t groups = K / gs;
  for (int64_t i = 0; i < count; i++) {
    int64_t u = ids[i] / 32;
    int c = (int)(ids[i] % 32);
    for (int64_t g = 0; g < groups; g++) {
      float s = param_at(scale, params, u, g, c, groups, gs);
      float o = param_at(offset, params, u, g, c, groups, gs);
      for (int k = 0; k < gs; k++)
        out[i * K + g * gs + k] = fmaf(s, (float)stored_at(q, bits, gs, groups, u, g, k, c), o);
    }
  }
}
