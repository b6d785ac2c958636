// What keeping a speculative update's old state costs, by store kind: the
// AdamW's memory pattern (three fp32 state streams read and written, one
// gradient stream read) with its maths replaced by one FMA a stream, in four
// variants, interleaved, medians of REPS:
//   inplace  the plain step: state read and written in place;
//   save     the engine's undo save: the old state streamed (non-temporal) to
//            save buffers in the same pass, the new one written in place;
//   oop_nt   out of place: the new state streamed to other buffers, the old
//            one left where it is (no extra bytes in theory);
//   oop_reg  out of place with ordinary stores (a read for ownership each).
// It decides between the save in the step's pass and an out-of-place kernel
// on a machine (docs/native.md, "An out-of-place step").
//
// Build and run (x86-64 with AVX2):
//   g++ -O2 -mavx2 -mfma scripts/bench/store_kinds.cpp -o /tmp/store_kinds
//   /tmp/store_kinds [parameters, default 12600000] [reps, default 25]
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

long n = 12600000;
float *P, *M, *V, *G, *SP, *SM, *SV;

inline __m256 upd(__m256 x, __m256 g) { return _mm256_fmadd_ps(x, _mm256_set1_ps(0.999f), g); }

void inplace() {
  for (long i = 0; i < n; i += 8) {
    const __m256 g = _mm256_load_ps(G + i);
    _mm256_store_ps(P + i, upd(_mm256_load_ps(P + i), g));
    _mm256_store_ps(M + i, upd(_mm256_load_ps(M + i), g));
    _mm256_store_ps(V + i, upd(_mm256_load_ps(V + i), g));
  }
}

void save() {
  for (long i = 0; i < n; i += 8) {
    const __m256 g = _mm256_load_ps(G + i);
    const __m256 p = _mm256_load_ps(P + i), m = _mm256_load_ps(M + i), v = _mm256_load_ps(V + i);
    _mm256_stream_ps(SP + i, p);
    _mm256_stream_ps(SM + i, m);
    _mm256_stream_ps(SV + i, v);
    _mm256_store_ps(P + i, upd(p, g));
    _mm256_store_ps(M + i, upd(m, g));
    _mm256_store_ps(V + i, upd(v, g));
  }
  _mm_sfence();
}

// Out of place: the new state to the S buffers, by streaming (NT) or ordinary stores.
template <bool NT>
void oop() {
  for (long i = 0; i < n; i += 8) {
    const __m256 g = _mm256_load_ps(G + i);
    float* dst[3] = {SP + i, SM + i, SV + i};
    const float* src[3] = {P + i, M + i, V + i};
    for (int k = 0; k < 3; k++) {
      const __m256 x = upd(_mm256_load_ps(src[k]), g);
      if (NT) _mm256_stream_ps(dst[k], x);
      else _mm256_store_ps(dst[k], x);
    }
  }
  if (NT) _mm_sfence();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1) n = std::max(8L, atol(argv[1]) / 8 * 8);
  const int reps = argc > 2 ? std::max(1, atoi(argv[2])) : 25;
  for (float** b : {&P, &M, &V, &G, &SP, &SM, &SV}) {
    *b = static_cast<float*>(aligned_alloc(64, static_cast<size_t>(n) * 4));
    if (!*b) return 1;
    for (long i = 0; i < n; i++) (*b)[i] = 1e-3f * static_cast<float>(i % 97);  // every page touched
  }
  void (*fn[4])() = {inplace, save, oop<true>, oop<false>};
  const char* name[4] = {"inplace", "save", "oop_nt", "oop_reg"};
  std::vector<double> ms[4];
  for (int r = 0; r < reps; r++) {
    for (int k = 0; k < 4; k++) {
      const auto a = std::chrono::steady_clock::now();
      fn[k]();
      ms[k].push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
    }
  }
  for (auto& t : ms) std::sort(t.begin(), t.end());
  const double base = ms[0][reps / 2];
  for (int k = 0; k < 4; k++)
    printf("%-8s median %7.1f ms  min %7.1f ms  median/inplace %.2f\n", name[k], ms[k][reps / 2], ms[k][0],
           ms[k][reps / 2] / base);
  return 0;
}
