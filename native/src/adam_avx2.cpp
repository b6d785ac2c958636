// AVX2 + FMA + F16C AdamW (8 fp32 lanes). Compiled with -mavx2 -mfma -mf16c
// only; chosen at run time when CPUID and XCR0 allow it.
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "isa.h"

namespace infinity_native {
namespace {
#include "lane1.inc"

struct Vec {
  using V = __m256;
  static constexpr int W = 8;
  static inline V set1(float x) { return _mm256_set1_ps(x); }
  static inline V loadf(const float* p) { return _mm256_loadu_ps(p); }
  static inline void storef(float* p, V x) { _mm256_storeu_ps(p, x); }
  static inline V load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static inline V load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static constexpr bool kStreaming = true;
  static inline void fence() { _mm_sfence(); }
  static inline void streamf(float* p, V x) { _mm256_stream_ps(p, x); }
  static inline void store8(uint16_t* p, __m128i x, bool nt) {
    if (nt) _mm_stream_si128(reinterpret_cast<__m128i*>(p), x);
    else _mm_storeu_si128(reinterpret_cast<__m128i*>(p), x);
  }
  template <bool NT = false>
  static inline void store_bf16(uint16_t* p, V x) {
    // Round to nearest even as torch does; NaN -> 0x7FC0.
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), is_nan);
    // Pack 8 x u32 (each <= 0xFFFF) into 8 x u16 in order.
    const __m256i packed = _mm256_packus_epi32(r, r);  // per 128-bit lane
    const __m256i ordered = _mm256_permute4x64_epi64(packed, 0x08);
    store8(p, _mm256_castsi256_si128(ordered), NT);
  }
  template <bool NT = false>
  static inline void store_f16(uint16_t* p, V x) {
    store8(p, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), NT);
  }
  static inline V add(V a, V b) { return _mm256_add_ps(a, b); }
  static inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static inline V sqrt(V a) { return _mm256_sqrt_ps(a); }
  static inline V div(V a, V b) { return _mm256_div_ps(a, b); }
  // Integer lanes and masks of the 8-bit moment codes (adam_q8.inc).
  using I = __m256i;
  using M = __m256;
  static inline I ibits(V x) { return _mm256_castps_si256(x); }
  static inline V fbits(I x) { return _mm256_castsi256_ps(x); }
  static inline I iset1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static inline I iadd(I a, I b) { return _mm256_add_epi32(a, b); }
  static inline I isub(I a, I b) { return _mm256_sub_epi32(a, b); }
  static inline I iand(I a, I b) { return _mm256_and_si256(a, b); }
  static inline I ior(I a, I b) { return _mm256_or_si256(a, b); }
  static inline I ixor(I a, I b) { return _mm256_xor_si256(a, b); }
  static inline I imul(I a, I b) { return _mm256_mullo_epi32(a, b); }  // low 32 bits
  template <int N> static inline I isrl(I a) { return _mm256_srli_epi32(a, N); }
  template <int N> static inline I isll(I a) { return _mm256_slli_epi32(a, N); }
  static inline V i2f(I a) { return _mm256_cvtepi32_ps(a); }
  static inline M ieq(I a, I b) { return _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, b)); }
  static inline M ilt(I a, I b) { return _mm256_castsi256_ps(_mm256_cmpgt_epi32(b, a)); }
  static inline M lt(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_LT_OQ); }
  static inline M eq(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_EQ_OQ); }
  static inline M isnan(V a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
  static inline V select(M k, V a, V b) { return _mm256_blendv_ps(b, a, k); }
  static inline I iselect(M k, I a, I b) { return ibits(_mm256_blendv_ps(fbits(b), fbits(a), k)); }
  static inline V abs(V a) { return _mm256_and_ps(a, fbits(iset1(0x7FFFFFFFu))); }
  static inline V max(V a, V b) { return _mm256_max_ps(a, b); }  // a > b ? a : b (NaN a: b)
  static inline float hmax(V a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
  }
  static inline I imax(I a, I b) { return _mm256_max_epi32(a, b); }
  static inline M unord(V a, V b) { return _mm256_cmp_ps(a, b, _CMP_UNORD_Q); }
  static inline M mor(M a, M b) { return _mm256_or_ps(a, b); }
  static inline bool many(M k) { return _mm256_movemask_ps(k) != 0; }
  static inline bool none_masked(const uint8_t* p, int64_t n, uint8_t m1, uint8_t v1, uint8_t m2, uint8_t v2) {
    const __m256i a1 = _mm256_set1_epi8(static_cast<char>(m1)), b1 = _mm256_set1_epi8(static_cast<char>(v1));
    const __m256i a2 = _mm256_set1_epi8(static_cast<char>(m2)), b2 = _mm256_set1_epi8(static_cast<char>(v2));
    __m256i any = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
      any = _mm256_or_si256(any, _mm256_or_si256(_mm256_cmpeq_epi8(_mm256_and_si256(x, a1), b1),
                                                 _mm256_cmpeq_epi8(_mm256_and_si256(x, a2), b2)));
    }
    return _mm256_testz_si256(any, any) && bytes_none(p + i, n - i, m1, v1, m2, v2);
  }
  static inline I load_s8(const uint8_t* p) {  // sign-extended
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  // 4 x 8 lanes holding 0..255 -> 32 bytes in lane order.
  static inline void store_u8x4(uint8_t* p, I a, I b, I c, I d) {
    const __m256i x = _mm256_packus_epi16(_mm256_packus_epi32(a, b), _mm256_packus_epi32(c, d));
    const __m256i q = _mm256_permutevar8x32_epi32(x, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), q);
  }
  // Two vectors rounded to bf16 (nearest even) as one 32-byte store; no NaN
  // handling: the caller checked that neither holds one.
  static inline __m256i bf16_bits(V x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  }
  template <bool NT = false>
  static inline void store_bf16x2(uint16_t* p, V a, V b) {
    const __m256i x = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits(a), bf16_bits(b)), 0xD8);
    if (NT) _mm256_stream_si256(reinterpret_cast<__m256i*>(p), x);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
  }
  // The codes of 4 x 8 lanes of q8_code_f's f bits (adam_q8.inc), stored as
  // 32 bytes in lane order; with signs, each code takes the sign of its float
  // at signs[i] (exp_avg). f's bits are k (< 2^(MB+2)) in the low half and
  // the exponent field E (< 2^8) at bit 23, so one multiply-add of the 16-bit
  // halves gives 2^(7-MB) * (k + E * 2^MB) exactly, packed to 16-bit lanes
  // and finished there, 16 lanes an op; the signs are packed by signed
  // saturation, which keeps each int32's sign.
  template <int MB>
  static inline void store_codes4(uint8_t* p, I a, I b, I c, I d, const float* signs) {
    const __m256i w = _mm256_set1_epi32((1 << 16) | (1 << (7 - MB)));
    const __m256i off = _mm256_set1_epi16(static_cast<short>((113 + 23 - MB) << MB));
    auto finish = [&](I x, I y) {
      const __m256i h = _mm256_packus_epi32(_mm256_madd_epi16(x, w), _mm256_madd_epi16(y, w));
      return _mm256_sub_epi16(_mm256_srli_epi16(h, 7 - MB), off);
    };
    __m256i q = _mm256_packus_epi16(finish(a, b), finish(c, d));
    if (signs) {
      auto ld = [&](int k) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(signs + 8 * k)); };
      const __m256i s = _mm256_packs_epi16(_mm256_packs_epi32(ld(0), ld(1)), _mm256_packs_epi32(ld(2), ld(3)));
      q = _mm256_or_si256(q, _mm256_and_si256(s, _mm256_set1_epi8(static_cast<char>(0x80))));
    }
    q = _mm256_permutevar8x32_epi32(q, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), q);
  }
  static inline I load_u8(const uint8_t* p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
  static inline void store_u8(uint8_t* p, I x) {  // lanes hold 0..255
    const __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(x, x), _mm256_packus_epi32(x, x));
    const __m256i q = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(q));
  }
};

#include "adam_kernel.inc"
#include "adam_bf16m.inc"
#include "adam_q8.inc"
#include "adam_bf16p.inc"
#include "sumsq_kernel.inc"
}  // namespace

namespace avx2 {
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
}  // namespace avx2
}  // namespace infinity_native
