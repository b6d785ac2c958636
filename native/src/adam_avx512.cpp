// AVX-512 (F/BW/VL/DQ) AdamW (16 fp32 lanes). Compiled with its own flags
// only; chosen at run time when CPUID and XCR0 (opmask + ZMM state) allow it.
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "isa.h"

namespace infinity_native {
namespace {
#include "lane1.inc"

struct Vec {
  using V = __m512;
  static constexpr int W = 16;
  static inline V set1(float x) { return _mm512_set1_ps(x); }
  static inline V loadf(const float* p) { return _mm512_loadu_ps(p); }
  static inline void storef(float* p, V x) { _mm512_storeu_ps(p, x); }
  static inline V load_bf16(const uint16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static inline V load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static constexpr bool kStreaming = true;
  static inline void fence() { _mm_sfence(); }
  static inline void streamf(float* p, V x) { _mm512_stream_ps(p, x); }
  static inline void store16(uint16_t* p, __m256i x, bool nt) {
    if (nt) _mm256_stream_si256(reinterpret_cast<__m256i*>(p), x);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
  }
  template <bool NT = false>
  static inline void store_bf16(uint16_t* p, V x) {
    // Round to nearest even as torch does; NaN -> 0x7FC0.
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(is_nan, r, _mm512_set1_epi32(0x7FC0));
    store16(p, _mm512_cvtepi32_epi16(r), NT);
  }
  template <bool NT = false>
  static inline void store_f16(uint16_t* p, V x) {
    store16(p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), NT);
  }
  static inline V add(V a, V b) { return _mm512_add_ps(a, b); }
  static inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static inline V sqrt(V a) { return _mm512_sqrt_ps(a); }
  static inline V div(V a, V b) { return _mm512_div_ps(a, b); }
  // Integer lanes and masks of the 8-bit moment codes (adam_q8.inc).
  using I = __m512i;
  using M = __mmask16;
  static inline I ibits(V x) { return _mm512_castps_si512(x); }
  static inline V fbits(I x) { return _mm512_castsi512_ps(x); }
  static inline I iset1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static inline I iadd(I a, I b) { return _mm512_add_epi32(a, b); }
  static inline I isub(I a, I b) { return _mm512_sub_epi32(a, b); }
  static inline I iand(I a, I b) { return _mm512_and_si512(a, b); }
  static inline I ior(I a, I b) { return _mm512_or_si512(a, b); }
  static inline I ixor(I a, I b) { return _mm512_xor_si512(a, b); }
  static inline I imul(I a, I b) { return _mm512_mullo_epi32(a, b); }  // low 32 bits
  template <int N> static inline I isrl(I a) { return _mm512_srli_epi32(a, N); }
  template <int N> static inline I isll(I a) { return _mm512_slli_epi32(a, N); }
  static inline V i2f(I a) { return _mm512_cvtepi32_ps(a); }
  static inline M ieq(I a, I b) { return _mm512_cmpeq_epi32_mask(a, b); }
  static inline M ilt(I a, I b) { return _mm512_cmplt_epi32_mask(a, b); }
  static inline M lt(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ); }
  static inline M eq(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }
  static inline M isnan(V a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
  static inline V select(M k, V a, V b) { return _mm512_mask_blend_ps(k, b, a); }
  static inline I iselect(M k, I a, I b) { return _mm512_mask_blend_epi32(k, b, a); }
  static inline V abs(V a) { return fbits(iand(ibits(a), iset1(0x7FFFFFFFu))); }
  static inline V max(V a, V b) { return _mm512_max_ps(a, b); }  // a > b ? a : b (NaN a: b)
  static inline float hmax(V a) { return _mm512_reduce_max_ps(a); }
  static inline I imax(I a, I b) { return _mm512_max_epi32(a, b); }
  static inline M unord(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q); }
  static inline M mor(M a, M b) { return static_cast<M>(a | b); }
  static inline bool many(M k) { return k != 0; }
  // 64 bytes a step by byte compares into a mask (AVX-512BW); bytes_none
  // (lane1.inc) takes the tail.
  static inline bool none_masked(const uint8_t* p, int64_t n, uint8_t m1, uint8_t v1, uint8_t m2, uint8_t v2) {
    const __m512i a1 = _mm512_set1_epi8(static_cast<char>(m1)), b1 = _mm512_set1_epi8(static_cast<char>(v1));
    const __m512i a2 = _mm512_set1_epi8(static_cast<char>(m2)), b2 = _mm512_set1_epi8(static_cast<char>(v2));
    __mmask64 any = 0;
    int64_t i = 0;
    for (; i + 64 <= n; i += 64) {
      const __m512i x = _mm512_loadu_si512(p + i);
      any |= _mm512_cmpeq_epi8_mask(_mm512_and_si512(x, a1), b1) | _mm512_cmpeq_epi8_mask(_mm512_and_si512(x, a2), b2);
    }
    return any == 0 && bytes_none(p + i, n - i, m1, v1, m2, v2);
  }
  static inline I load_s8(const uint8_t* p) {  // sign-extended
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline void store_u8x4(uint8_t* p, I a, I b, I c, I d) {
    store_u8(p, a);
    store_u8(p + 16, b);
    store_u8(p + 32, c);
    store_u8(p + 48, d);
  }
  // Two vectors rounded to bf16 (nearest even); no NaN handling: the caller
  // checked that neither holds one.
  template <bool NT = false>
  static inline void store_bf16x2(uint16_t* p, V a, V b) {
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF);
    const __m512i ua = _mm512_castps_si512(a), ub = _mm512_castps_si512(b);
    const __m512i ra = _mm512_srli_epi32(_mm512_add_epi32(ua, _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(ua, 16), one), half)), 16);
    const __m512i rb = _mm512_srli_epi32(_mm512_add_epi32(ub, _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(ub, 16), one), half)), 16);
    store16(p, _mm512_cvtepi32_epi16(ra), NT);
    store16(p + 16, _mm512_cvtepi32_epi16(rb), NT);
  }
  // The codes of 4 x 16 lanes of q8_code_f's f bits (adam_q8.inc), stored
  // as 64 bytes in lane order: AVX2's store_codes4 (adam_avx2.cpp says why
  // the multiply-add is exact) on four 128-bit lanes, whose packs interleave
  // the vectors by 4 elements; one dword permute puts them back in order.
  template <int MB>
  static inline void store_codes4(uint8_t* p, I a, I b, I c, I d, const float* signs) {
    const __m512i w = _mm512_set1_epi32((1 << 16) | (1 << (7 - MB)));
    const __m512i off = _mm512_set1_epi16(static_cast<short>((113 + 23 - MB) << MB));
    auto finish = [&](I x, I y) {
      const __m512i h = _mm512_packus_epi32(_mm512_madd_epi16(x, w), _mm512_madd_epi16(y, w));
      return _mm512_sub_epi16(_mm512_srli_epi16(h, 7 - MB), off);
    };
    __m512i q = _mm512_packus_epi16(finish(a, b), finish(c, d));
    if (signs) {
      auto ld = [&](int k) { return _mm512_castps_si512(_mm512_loadu_ps(signs + 16 * k)); };
      const __m512i s = _mm512_packs_epi16(_mm512_packs_epi32(ld(0), ld(1)), _mm512_packs_epi32(ld(2), ld(3)));
      q = _mm512_or_si512(q, _mm512_and_si512(s, _mm512_set1_epi8(static_cast<char>(0x80))));
    }
    q = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), q);
    _mm512_storeu_si512(p, q);
  }
  static inline I load_u8(const uint8_t* p) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline void store_u8(uint8_t* p, I x) {  // lanes hold 0..255
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x));
  }
};

#include "adam_kernel.inc"
#include "adam_bf16m.inc"
#include "adam_q8.inc"
#include "adam_bf16p.inc"
#include "sumsq_kernel.inc"
}  // namespace

namespace avx512 {
void adam_range(float* p, const void* g, float* m, float* v, void* out, int64_t n, int32_t gdt,
                int32_t odt, const AdamConsts& c, bool probe) {
  adam_range_entry(p, g, m, v, out, n, gdt, odt, c, probe);
}
void lowbit_range(float* p, const void* g, void* m, void* v, float* ms, float* vs, void* out, int64_t n,
                  int32_t gdt, int32_t odt, int32_t mdt, const AdamConsts& c, bool probe) {
  lowbit_range_entry(p, g, m, v, ms, vs, out, n, gdt, odt, mdt, c, probe);
}
void bf16p_range(uint16_t* p, const void* g, void* m, void* v, float* ms, float* vs, int64_t n, int32_t gdt,
                 int32_t mdt, const AdamConsts& c, uint64_t k_step, uint64_t index0) {
  bf16p_range_entry(p, g, m, v, ms, vs, n, gdt, mdt, c, k_step, index0);
}
double sumsq_block(const void* x, int64_t n, int32_t dt) { return sumsq_block_entry(x, n, dt); }
}  // namespace avx512
}  // namespace infinity_native
