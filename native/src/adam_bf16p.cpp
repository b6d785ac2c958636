// Dispatch of AdamW over a bf16 master (inf_adam_step_bf16p): ISA choice,
// argument checks, the per-tensor rounding keys, and the split of a
// multi-tensor call over the thread pool. The kernel is adam_bf16p.inc; the
// split cannot change a byte ([Note: stochastic rounding of the bf16 master]).
#include <stdint.h>

#include <vector>

#include "infinity_native.h"
#include "isa.h"
#include "thread_pool.h"
#include "thread_split.h"

using namespace infinity_native;

namespace {

Bf16pRangeFn bf16p_fn(int32_t isa) {
  switch (isa) {
#if defined(INF_HAVE_SCALAR)
    case INF_ISA_SCALAR: return scalar::bf16p_range;
#endif
#if defined(INF_HAVE_AVX2)
    case INF_ISA_AVX2: return avx2::bf16p_range;
#endif
#if defined(INF_HAVE_AVX512)
    case INF_ISA_AVX512: return avx512::bf16p_range;
#endif
#if defined(INF_HAVE_NEON)
    case INF_ISA_NEON: return neon::bf16p_range;
#endif
    default: return nullptr;
  }
}

uint64_t mix64(uint64_t z) {  // splitmix64's finaliser, as sr_mix64 in adam_bf16p.inc
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Work is split in units: elements for fp32/bf16 moments (thread bounds at
// multiples of kChunkAlign), whole blocks for 8-bit ones.
struct Bf16pJob {
  Bf16pRangeFn fn;
  const int64_t* ptrs;
  const int64_t* numels;
  const int64_t* offsets;
  const uint64_t* keys;   // K of the Note, per tensor
  int64_t n_tensors;
  const int64_t* prefix;  // prefix[i] = first global unit of tensor i
  int64_t unit, align;
  int32_t gdt, mdt;
  int gsize, msize;
  AdamConsts c;
  int nthreads;
};

void run_bf16p_chunk(void* raw, int tid) {
  const Bf16pJob& j = *static_cast<const Bf16pJob*>(raw);
  const int64_t n = j.n_tensors;
  for_thread_share(j.prefix, j.numels, n, j.unit, j.align, j.nthreads, tid,
                   [&](int64_t t, int64_t s, int64_t first, int64_t count) {
    const TensorSlice b = slice_at(j.ptrs, n, t, first, s, 2, j.gsize, j.msize, 0, j.mdt == INF_DT_I8);
    const uint64_t index0 = static_cast<uint64_t>(j.offsets ? j.offsets[t] : 0) + static_cast<uint64_t>(first);
    j.fn(reinterpret_cast<uint16_t*>(b.p), b.g, b.m, b.v, b.ms, b.vs, count, j.gdt, j.mdt, j.c, j.keys[t], index0);
  });
}

int dt_bytes(int32_t dt) {
  return dt == INF_DT_F32 ? 4 : (dt == INF_DT_BF16 || dt == INF_DT_F16) ? 2 : dt == INF_DT_I8 ? 1 : 0;
}

// Argument checks of one tensor: its buffers, and an 8-bit shard's offset on a block edge.
bool tensor_ok(const int64_t* ptrs, int64_t n, int64_t i, int64_t numel, int64_t offset, bool q8) {
  if (numel < 0 || offset < 0) return false;
  if (q8 && offset % INF_QBLOCK != 0) return false;
  if (numel == 0) return true;
  for (int k = 0; k < 4; ++k)
    if (ptrs[k * n + i] == 0) return false;
  if (ptrs[4 * n + i] != 0) return false;  // no copy-out: the master is the compute copy
  return !q8 || (ptrs[5 * n + i] != 0 && ptrs[6 * n + i] != 0);
}

}  // namespace

extern "C" {

int32_t inf_adam_step_bf16p(int32_t isa, int64_t n_tensors, const int64_t* ptrs, const int64_t* numels,
                            const int64_t* offsets, const uint64_t* streams, int32_t grad_dtype,
                            int32_t moment_dtype, const inf_adam_hparams* hp, uint64_t seed, int64_t step) {
  if (!hp || n_tensors < 0 || (n_tensors > 0 && (!ptrs || !numels))) return INF_E_INVAL;
  if (grad_dtype == INF_DT_I8 || dt_bytes(grad_dtype) == 0 || dt_bytes(moment_dtype) == 0 ||
      moment_dtype == INF_DT_F16 || step < 1)
    return INF_E_INVAL;
  if (isa < 0) isa = inf_isa_best();
  if (!((inf_isa_compiled() & inf_isa_supported()) & (1u << isa))) return INF_E_ISA;
  Bf16pRangeFn fn = bf16p_fn(isa);
  if (!fn) return INF_E_ISA;
  if (n_tensors == 0) return INF_OK;
  const bool q8 = moment_dtype == INF_DT_I8;
  const int64_t unit = q8 ? INF_QBLOCK : 1;
  std::vector<int64_t> prefix(n_tensors + 1);
  std::vector<uint64_t> keys(n_tensors);
  prefix[0] = 0;
  const uint64_t kseed = mix64(seed);
  for (int64_t i = 0; i < n_tensors; ++i) {
    if (!tensor_ok(ptrs, n_tensors, i, numels[i], offsets ? offsets[i] : 0, q8)) return INF_E_INVAL;
    prefix[i + 1] = prefix[i] + (numels[i] + unit - 1) / unit;
    keys[i] = mix64(mix64(kseed ^ (streams ? streams[i] : 0)) + static_cast<uint64_t>(step));
  }
  int nt = hp->num_threads > 0 ? hp->num_threads : default_threads();
  const int64_t by_size = prefix[n_tensors] * unit / kMinElemsPerThread;
  if (by_size < nt) nt = by_size < 1 ? 1 : static_cast<int>(by_size);
  Bf16pJob job{fn, ptrs, numels, offsets, keys.data(), n_tensors, prefix.data(), unit, q8 ? 1 : kChunkAlign,
               grad_dtype, moment_dtype, dt_bytes(grad_dtype), dt_bytes(moment_dtype), adam_consts(*hp), nt};
  parallel_run(nt, run_bf16p_chunk, &job);
  return INF_OK;
}

}  // extern "C"
