// The share of one thread in a multi-tensor call split by units (elements,
// or 8-bit blocks), used by the low-bit and bf16-master dispatchers.
#pragma once
#include <stdint.h>

namespace infinity_native {

// Calls f(t, s, first, count) for every tensor t with elements in thread
// tid's share of nthreads: its units from s (counted from the tensor's unit
// 0, of `unit` elements each), elements [first, first + count) of numels[t].
// prefix[i] is the first global unit of tensor i (prefix[n] the total);
// shares are cut at multiples of align units.
template <class F>
inline void for_thread_share(const int64_t* prefix, const int64_t* numels, int64_t n, int64_t unit, int64_t align,
                             int nthreads, int tid, F&& f) {
  const int64_t total = prefix[n];
  auto bound = [&](int t) {
    const int64_t b = total * t / nthreads;
    return t == nthreads ? total : b - b % align;
  };
  const int64_t lo = bound(tid), hi = bound(tid + 1);
  for (int64_t t = 0; t < n && prefix[t] < hi; ++t) {
    if (prefix[t + 1] <= lo) continue;
    const int64_t s = (lo > prefix[t] ? lo : prefix[t]) - prefix[t];
    const int64_t e = (hi < prefix[t + 1] ? hi : prefix[t + 1]) - prefix[t];
    const int64_t first = s * unit, count = (e * unit < numels[t] ? e * unit : numels[t]) - first;
    if (count > 0) f(t, s, first, count);
  }
}

// The buffers of tensor t from its element first (its 8-bit block s) in the
// 7*n pointer layout of inf_adam_step_moments: params (psize bytes an
// element), grads, exp_avg, exp_avg_sq, outs (osize 0: none), and with q8 the
// two scale arrays.
struct TensorSlice {
  char* p; const char* g; char* m; char* v; char* o; float* ms; float* vs;
};
inline TensorSlice slice_at(const int64_t* ptrs, int64_t n, int64_t t, int64_t first, int64_t s, int psize,
                            int gsize, int msize, int osize, bool q8) {
  auto at = [&](int k, int size) { return reinterpret_cast<char*>(ptrs[k * n + t]) + first * size; };
  return {at(0, psize), at(1, gsize), at(2, msize), at(3, msize), osize ? at(4, osize) : nullptr,
          q8 ? reinterpret_cast<float*>(ptrs[5 * n + t]) + s : nullptr,
          q8 ? reinterpret_cast<float*>(ptrs[6 * n + t]) + s : nullptr};
}

}  // namespace infinity_native
