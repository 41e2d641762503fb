// The vector layer under agentspec's native kernels: one set of operations on LANES float32
// (vf) or int32 (vi) lanes, 16 on AVX-512 (one zmm), 8 on AVX2 with FMA and F16C (one ymm), 4
// on ARMv8's NEON (one q register). The kernels are written once over it. Every operation is
// lane-wise and rounds as its scalar statement does (an fma rounded once, float16 and bfloat16
// widened exactly, float16 narrowed to nearest even, integer sums exact), so a kernel's bits do
// not depend on LANES: a build for any of these instruction sets gives the same bits. Without
// one (AS_VEC undefined) the kernels' portable loops compute the same products one element at
// a time.
//
// Each set also says how large the kernels' register tiles are (its register file: 32 zmm, 16
// ymm, 32 q): PASS_ROWS, the input rows a product keeps in registers; TILE_RUNS, the runs of 16
// keys one attention score tile covers (for four queries); VALUE_QUERIES, the queries a value
// tile of 4 * LANES dims takes. Tiles change no bits: every sum runs in the same order.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define AS_AVX512 1
#define AS_VEC 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define AS_AVX2 1
#define AS_VEC 1
#elif defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#define AS_NEON 1
#define AS_VEC 1
#endif

#ifdef AS_AVX512
static const int LANES = 16, PASS_ROWS = 8, TILE_RUNS = 4, VALUE_QUERIES = 4;
typedef __m512 vf;
typedef __m512i vi;
static inline vf vf_zero() { return _mm512_setzero_ps(); }
static inline vf vf_set(float x) { return _mm512_set1_ps(x); }
static inline vf vf_load(const float* p) { return _mm512_loadu_ps(p); }
static inline void vf_store(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vf_round(vf x) {  // to the nearest integer, ties to even (nearbyintf)
  return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vi vf_int(vf x) { return _mm512_cvtps_epi32(x); }  // an integral x, exactly
static inline vf vf_bits(vi x) { return _mm512_castsi512_ps(x); }
static inline vf vf_half(const uint16_t* p) {  // LANES float16, widened
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
static inline void vf_store_half(uint16_t* p, vf v) {  // narrowed to nearest even
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline vf vf_pick(unsigned bits, vf yes, vf no) {  // lane l: bit l of bits ? yes : no
  return _mm512_mask_blend_ps((__mmask16)bits, no, yes);
}
static inline vf vf_unless_neg_inf(vf x, vf v) {  // lane: x == -inf ? +0 : v
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ), v);
}
static inline float vf_max_all(vf v) { return _mm512_reduce_max_ps(v); }
static inline vi vi_zero() { return _mm512_setzero_si512(); }
static inline vi vi_load(const void* p) { return _mm512_loadu_si512(p); }
static inline vi vi_set(int32_t x) { return _mm512_set1_epi32(x); }
static inline vi vi_shl(vi x, int n) { return _mm512_slli_epi32(x, n); }
static inline vi vi_and(vi a, vi b) { return _mm512_and_si512(a, b); }
static inline vi vi_add(vi a, vi b) { return _mm512_add_epi32(a, b); }
static inline vf vi_float(vi x) { return _mm512_cvtepi32_ps(x); }
static inline vi vi_bytes(const uint8_t* p) {  // LANES signed byte pairs, each byte to 16 bits
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p));
}
static inline void vi_nibbles(const uint8_t* p, vi& lo, vi& hi) {  // the same, low and high nibbles
  __m256i v = _mm256_loadu_si256((const __m256i*)p);
  lo = _mm512_cvtepu8_epi16(_mm256_and_si256(v, _mm256_set1_epi8(0x0f)));
  hi = _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0f)));
}
static inline vi vi_int8(const int8_t* p) {  // LANES int8, widened
  return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p));
}
static inline vi vi_bits16(const uint8_t* p, int16_t value) {  // 2 * LANES bits (LANES / 4
  uint32_t m;                                                     // bytes): each bit's 16-bit
  memcpy(&m, p, 4);                                               // element value where set
  return _mm512_maskz_mov_epi16((__mmask32)m, _mm512_set1_epi16(value));
}
static inline vi vi_or(vi a, vi b) { return _mm512_or_si512(a, b); }
static inline vi vi_sub16(vi a, int16_t b) { return _mm512_sub_epi16(a, _mm512_set1_epi16(b)); }
static inline vi vi_dot(vi s, vi w, vi x) {  // s + w.lo * x.lo + w.hi * x.hi per 32-bit lane
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(s, w, x);
#else
  return _mm512_add_epi32(s, _mm512_madd_epi16(w, x));
#endif
}
#elif defined(AS_AVX2)
static const int LANES = 8, PASS_ROWS = 4, TILE_RUNS = 1, VALUE_QUERIES = 2;
typedef __m256 vf;
typedef __m256i vi;
static inline vf vf_zero() { return _mm256_setzero_ps(); }
static inline vf vf_set(float x) { return _mm256_set1_ps(x); }
static inline vf vf_load(const float* p) { return _mm256_loadu_ps(p); }
static inline void vf_store(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vf_add(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vf_sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vf_mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vf_div(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vf_min(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vf_max(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vf_round(vf x) {
  return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline vi vf_int(vf x) { return _mm256_cvtps_epi32(x); }
static inline vf vf_bits(vi x) { return _mm256_castsi256_ps(x); }
static inline vf vf_half(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
}
static inline void vf_store_half(uint16_t* p, vf v) {
  _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
static inline vf vf_pick(unsigned bits, vf yes, vf no) {
  const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)bits), lane), lane);
  return _mm256_blendv_ps(no, yes, _mm256_castsi256_ps(on));
}
static inline vf vf_unless_neg_inf(vf x, vf v) {
  return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ), v);
}
static inline float vf_max_all(vf v) {  // max is exact: any order gives the same value
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
static inline vi vi_zero() { return _mm256_setzero_si256(); }
static inline vi vi_load(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline vi vi_set(int32_t x) { return _mm256_set1_epi32(x); }
static inline vi vi_shl(vi x, int n) { return _mm256_slli_epi32(x, n); }
static inline vi vi_and(vi a, vi b) { return _mm256_and_si256(a, b); }
static inline vi vi_add(vi a, vi b) { return _mm256_add_epi32(a, b); }
static inline vf vi_float(vi x) { return _mm256_cvtepi32_ps(x); }
static inline vi vi_bytes(const uint8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p));
}
static inline void vi_nibbles(const uint8_t* p, vi& lo, vi& hi) {
  __m128i v = _mm_loadu_si128((const __m128i*)p);
  lo = _mm256_cvtepu8_epi16(_mm_and_si128(v, _mm_set1_epi8(0x0f)));
  hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f)));
}
static inline vi vi_int8(const int8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p));
}
static inline vi vi_bits16(const uint8_t* p, int16_t value) {
  uint16_t m;
  memcpy(&m, p, 2);
  const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048,
                                        4096, 8192, 16384, (int16_t)0x8000);
  __m256i on = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((int16_t)m), bit), bit);
  return _mm256_and_si256(on, _mm256_set1_epi16(value));
}
static inline vi vi_or(vi a, vi b) { return _mm256_or_si256(a, b); }
static inline vi vi_sub16(vi a, int16_t b) { return _mm256_sub_epi16(a, _mm256_set1_epi16(b)); }
static inline vi vi_dot(vi s, vi w, vi x) { return _mm256_add_epi32(s, _mm256_madd_epi16(w, x)); }
#elif defined(AS_NEON)
static const int LANES = 4, PASS_ROWS = 8, TILE_RUNS = 1, VALUE_QUERIES = 4;
typedef float32x4_t vf;
typedef int32x4_t vi;
static inline vf vf_zero() { return vdupq_n_f32(0.0f); }
static inline vf vf_set(float x) { return vdupq_n_f32(x); }
static inline vf vf_load(const float* p) { return vld1q_f32(p); }
static inline void vf_store(float* p, vf v) { vst1q_f32(p, v); }
static inline vf vf_add(vf a, vf b) { return vaddq_f32(a, b); }
static inline vf vf_sub(vf a, vf b) { return vsubq_f32(a, b); }
static inline vf vf_mul(vf a, vf b) { return vmulq_f32(a, b); }
static inline vf vf_div(vf a, vf b) { return vdivq_f32(a, b); }
static inline vf vf_min(vf a, vf b) { return vminq_f32(a, b); }
static inline vf vf_max(vf a, vf b) { return vmaxq_f32(a, b); }
static inline vf vf_fma(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
static inline vf vf_round(vf x) { return vrndnq_f32(x); }
static inline vi vf_int(vf x) { return vcvtnq_s32_f32(x); }
static inline vf vf_bits(vi x) { return vreinterpretq_f32_s32(x); }
static inline vf vf_half(const uint16_t* p) {
  return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
}
static inline void vf_store_half(uint16_t* p, vf v) {  // FPCR's rounding: nearest even
  vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(v)));
}
static inline vf vf_pick(unsigned bits, vf yes, vf no) {
  const uint32_t lane[4] = {1, 2, 4, 8};
  return vbslq_f32(vtstq_u32(vdupq_n_u32(bits), vld1q_u32(lane)), yes, no);
}
static inline vf vf_unless_neg_inf(vf x, vf v) {
  uint32x4_t inf = vceqq_f32(x, vdupq_n_f32(-INFINITY));
  return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(v), inf));
}
static inline float vf_max_all(vf v) { return vmaxvq_f32(v); }
static inline vi vi_zero() { return vdupq_n_s32(0); }
static inline vi vi_load(const void* p) { return vld1q_s32((const int32_t*)p); }
static inline vi vi_set(int32_t x) { return vdupq_n_s32(x); }
static inline vi vi_shl(vi x, int n) { return vshlq_s32(x, vdupq_n_s32(n)); }
static inline vi vi_and(vi a, vi b) { return vandq_s32(a, b); }
static inline vi vi_add(vi a, vi b) { return vaddq_s32(a, b); }
static inline vf vi_float(vi x) { return vcvtq_f32_s32(x); }
static inline vi vi_bytes(const uint8_t* p) {
  return vreinterpretq_s32_s16(vmovl_s8(vld1_s8((const int8_t*)p)));
}
static inline void vi_nibbles(const uint8_t* p, vi& lo, vi& hi) {
  uint8x8_t v = vld1_u8(p);
  lo = vreinterpretq_s32_u16(vmovl_u8(vand_u8(v, vdup_n_u8(0x0f))));
  hi = vreinterpretq_s32_u16(vmovl_u8(vshr_n_u8(v, 4)));
}
static inline vi vi_int8(const int8_t* p) {  // four bytes, no further
  int32_t w;
  memcpy(&w, p, 4);
  return vmovl_s16(vget_low_s16(vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w)))));
}
static inline vi vi_bits16(const uint8_t* p, int16_t value) {
  const uint16_t bit[8] = {1, 2, 4, 8, 16, 32, 64, 128};
  uint16x8_t on = vtstq_u16(vdupq_n_u16(p[0]), vld1q_u16(bit));
  return vreinterpretq_s32_u16(vandq_u16(on, vdupq_n_u16((uint16_t)value)));
}
static inline vi vi_or(vi a, vi b) { return vorrq_s32(a, b); }
static inline vi vi_sub16(vi a, int16_t b) {
  return vreinterpretq_s32_s16(vsubq_s16(vreinterpretq_s16_s32(a), vdupq_n_s16(b)));
}
static inline vi vi_dot(vi s, vi w, vi x) {  // each lane's two 16-bit products, added
  int16x8_t a = vreinterpretq_s16_s32(w), b = vreinterpretq_s16_s32(x);
  int32x4_t lo = vmull_s16(vget_low_s16(a), vget_low_s16(b)), hi = vmull_high_s16(a, b);
  return vaddq_s32(s, vpaddq_s32(lo, hi));
}
#endif

// exp by one fixed polynomial, the same on every path (not the C library's, which differs
// between libraries): x clamped, n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), a
// degree-6 polynomial in r, times 2^n. vf_exp computes the same, lane by lane.
static const float EXP_LOW = -87.0f, EXP_HIGH = 88.0f, EXP_LOG2E = 1.44269504088896341f;
static const float EXP_LN2[2] = {0.693145751953125f, 1.428606765330187e-06f};
static const float EXP_POLY[7] = {1.3888889e-03f, 8.3333333e-03f, 4.1666668e-02f,
                                  1.6666667e-01f, 0.5f, 1.0f, 1.0f};

static inline float exp_fixed(float x) {
  x = fminf(fmaxf(x, EXP_LOW), EXP_HIGH);
  float n = nearbyintf(x * EXP_LOG2E);
  float r = fmaf(n, -EXP_LN2[0], x);
  r = fmaf(n, -EXP_LN2[1], r);
  float p = EXP_POLY[0];
  for (int i = 1; i < 7; i++) p = fmaf(p, r, EXP_POLY[i]);
  uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
  float s;
  memcpy(&s, &bits, 4);
  return p * s;
}

#ifdef AS_VEC
// Lanes from fixed-point steps shared by every width.
static inline vi vi_pair(const int16_t* x, int64_t i) {  // inputs 2i, 2i + 1 in every lane
  int32_t v;
  memcpy(&v, x + 2 * i, 4);
  return vi_set(v);
}

// exp as exp_fixed computes it, lane by lane.
static inline vf vf_exp(vf x) {
  x = vf_min(vf_max(x, vf_set(EXP_LOW)), vf_set(EXP_HIGH));
  vf n = vf_round(vf_mul(x, vf_set(EXP_LOG2E)));
  vf r = vf_fma(n, vf_set(-EXP_LN2[0]), x);
  r = vf_fma(n, vf_set(-EXP_LN2[1]), r);
  vf p = vf_set(EXP_POLY[0]);
  for (int i = 1; i < 7; i++) p = vf_fma(p, r, vf_set(EXP_POLY[i]));
  return vf_mul(p, vf_bits(vi_shl(vi_add(vf_int(n), vi_set(127)), 23)));
}
#endif
