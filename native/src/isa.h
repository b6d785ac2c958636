// Internal declarations shared by the dispatcher and the per-ISA kernels.
#pragma once
#include <stdint.h>
#include "infinity_native.h"

// ISA levels the CPU and OS support (bit i = level i). Never fails.
uint32_t inf_cpu_isa_mask();

namespace infinity_native {

// Per-call constants, derived once from inf_adam_hparams (see adam.cpp).
struct AdamConsts {
  float lr_decay;       // AdamW: 1 - lr*wd (params scaled first); Adam: 1
  float l2;             // Adam: wd added to the gradient as wd*param; AdamW: 0
  float one_minus_b1;   // lerp weight of exp_avg
  float beta2;
  float one_minus_b2;
  float neg_step_size;  // -lr / bias_correction1
  float bc2_sqrt;       // sqrt(bias_correction2)
  float eps;
  float grad_scale;
  bool adamw;           // decoupled weight decay
};

// Updates elements [0, n) of one tensor. g and out are typed by the dtypes.
// probe=true replaces the maths by trivial adds with the same memory traffic.
using RangeFn = void (*)(float* p, const void* g, float* m, float* v, void* out, int64_t n,
                         int32_t grad_dtype, int32_t out_dtype, const AdamConsts& c, bool probe);

#if defined(INF_HAVE_SCALAR)
namespace scalar { void adam_range(float*, const void*, float*, float*, void*, int64_t, int32_t, int32_t, const AdamConsts&, bool); }
#endif
#if defined(INF_HAVE_AVX2)
namespace avx2 { void adam_range(float*, const void*, float*, float*, void*, int64_t, int32_t, int32_t, const AdamConsts&, bool); }
#endif
#if defined(INF_HAVE_AVX512)
namespace avx512 { void adam_range(float*, const void*, float*, float*, void*, int64_t, int32_t, int32_t, const AdamConsts&, bool); }
#endif
#if defined(INF_HAVE_NEON)
namespace neon { void adam_range(float*, const void*, float*, float*, void*, int64_t, int32_t, int32_t, const AdamConsts&, bool); }
#endif

}  // namespace infinity_native
