// NEON (AArch64 ASIMD) AdamW (4 fp32 lanes). ASIMD is baseline on AArch64.
#include <arm_neon.h>
#include <math.h>
#include <string.h>

#include "isa.h"

namespace infinity_native {
namespace {
#include "lane1.inc"

struct Vec {
  using V = float32x4_t;
  static constexpr int W = 4;
  static inline V set1(float x) { return vdupq_n_f32(x); }
  static inline V loadf(const float* p) { return vld1q_f32(p); }
  static inline void storef(float* p, V x) { vst1q_f32(p, x); }
  static inline V load_bf16(const uint16_t* p) {
    return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
  }
  static inline V load_f16(const uint16_t* p) {
    return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p)));
  }
  static constexpr bool kStreaming = false;
  static inline void fence() {}
  static inline void streamf(float* p, V x) { vst1q_f32(p, x); }
  template <bool NT = false>
  static inline void store_bf16(uint16_t* p, V x) {
    // Round to nearest even as torch does; NaN -> 0x7FC0.
    const uint32x4_t u = vreinterpretq_u32_f32(x);
    const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    uint32x4_t r = vshrq_n_u32(vaddq_u32(u, vaddq_u32(lsb, vdupq_n_u32(0x7FFF))), 16);
    const uint32x4_t is_num = vceqq_f32(x, x);
    r = vbslq_u32(is_num, r, vdupq_n_u32(0x7FC0));
    vst1_u16(p, vmovn_u32(r));
  }
  template <bool NT = false>
  static inline void store_f16(uint16_t* p, V x) {
    // FPCR default rounding is to nearest even.
    vst1_u16(p, vreinterpret_u16_f16(vcvt_f16_f32(x)));
  }
  static inline V add(V a, V b) { return vaddq_f32(a, b); }
  static inline V sub(V a, V b) { return vsubq_f32(a, b); }
  static inline V mul(V a, V b) { return vmulq_f32(a, b); }
  static inline V fma(V a, V b, V c) { return vfmaq_f32(c, a, b); }  // c + a*b, one rounding
  static inline V sqrt(V a) { return vsqrtq_f32(a); }
  static inline V div(V a, V b) { return vdivq_f32(a, b); }
  // Integer lanes and masks of the 8-bit moment codes (adam_q8.inc).
  using I = uint32x4_t;
  using M = uint32x4_t;
  static inline I ibits(V x) { return vreinterpretq_u32_f32(x); }
  static inline V fbits(I x) { return vreinterpretq_f32_u32(x); }
  static inline I iset1(uint32_t x) { return vdupq_n_u32(x); }
  static inline I iadd(I a, I b) { return vaddq_u32(a, b); }
  static inline I isub(I a, I b) { return vsubq_u32(a, b); }
  static inline I iand(I a, I b) { return vandq_u32(a, b); }
  static inline I ior(I a, I b) { return vorrq_u32(a, b); }
  static inline I ixor(I a, I b) { return veorq_u32(a, b); }
  static inline I imul(I a, I b) { return vmulq_u32(a, b); }  // low 32 bits
  template <int N> static inline I isrl(I a) { return vshrq_n_u32(a, N); }
  template <int N> static inline I isll(I a) { return vshlq_n_u32(a, N); }
  static inline V i2f(I a) { return vcvtq_f32_s32(vreinterpretq_s32_u32(a)); }
  static inline M ieq(I a, I b) { return vceqq_u32(a, b); }
  static inline M ilt(I a, I b) { return vcltq_s32(vreinterpretq_s32_u32(a), vreinterpretq_s32_u32(b)); }
  static inline M lt(V a, V b) { return vcltq_f32(a, b); }
  static inline M eq(V a, V b) { return vceqq_f32(a, b); }
  static inline M isnan(V a) { return vmvnq_u32(vceqq_f32(a, a)); }
  static inline V select(M k, V a, V b) { return vbslq_f32(k, a, b); }
  static inline I iselect(M k, I a, I b) { return vbslq_u32(k, a, b); }
  static inline V abs(V a) { return vabsq_f32(a); }
  // a > b ? a : b as on x86 (vmaxq_f32 would return NaN for a NaN a).
  static inline V max(V a, V b) { return vbslq_f32(vcgtq_f32(a, b), a, b); }
  static inline float hmax(V a) { return vmaxvq_f32(a); }
  static inline I imax(I a, I b) { return vreinterpretq_u32_s32(vmaxq_s32(vreinterpretq_s32_u32(a), vreinterpretq_s32_u32(b))); }
  static inline M unord(V a, V b) { return vmvnq_u32(vandq_u32(vceqq_f32(a, a), vceqq_f32(b, b))); }
  static inline M mor(M a, M b) { return vorrq_u32(a, b); }
  static inline bool many(M k) { return vmaxvq_u32(k) != 0; }
  static inline bool none_masked(const uint8_t* p, int64_t n, uint8_t m1, uint8_t v1, uint8_t m2, uint8_t v2) {
    return bytes_none(p, n, m1, v1, m2, v2);
  }
  static inline I load_s8(const uint8_t* p) {  // sign-extended
    uint32_t w;
    memcpy(&w, p, 4);
    const int16x8_t h = vmovl_s8(vreinterpret_s8_u32(vdup_n_u32(w)));
    return vreinterpretq_u32_s32(vmovl_s16(vget_low_s16(h)));
  }
  static inline void store_u8x4(uint8_t* p, I a, I b, I c, I d) {
    store_u8(p, a);
    store_u8(p + 4, b);
    store_u8(p + 8, c);
    store_u8(p + 12, d);
  }
  template <bool NT = false>
  static inline void store_bf16x2(uint16_t* p, V a, V b) {  // caller checked: no NaN
    store_bf16<NT>(p, a);
    store_bf16<NT>(p + 4, b);
  }
  static inline I load_u8(const uint8_t* p) {
    uint32_t w;
    memcpy(&w, p, 4);
    return vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(w)))));
  }
  static inline void store_u8(uint8_t* p, I x) {  // lanes hold 0..255
    const uint16x4_t h = vmovn_u32(x);
    const uint32_t w = vget_lane_u32(vreinterpret_u32_u8(vmovn_u16(vcombine_u16(h, h))), 0);
    memcpy(p, &w, 4);
  }
};

#include "adam_kernel.inc"
#include "adam_bf16m.inc"
#include "adam_q8.inc"
#include "adam_bf16p.inc"
#include "sumsq_kernel.inc"
}  // namespace

namespace neon {
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
}  // namespace neon
}  // namespace infinity_native
