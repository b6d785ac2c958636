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
};

#include "adam_kernel.inc"
}  // namespace

namespace neon {
void adam_range(float* p, const void* g, float* m, float* v, void* out, int64_t n, int32_t gdt,
                int32_t odt, const AdamConsts& c, bool probe) {
  adam_range_entry(p, g, m, v, out, n, gdt, odt, c, probe);
}
}  // namespace neon
}  // namespace infinity_native
