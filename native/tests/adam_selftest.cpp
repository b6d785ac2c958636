// Stand-alone check of the AdamW kernels through the C ABI, without Python:
// every ISA variant this CPU supports must equal the scalar variant bit for
// bit, for all gradient and copy-out dtypes, at awkward sizes, and the scalar
// variant must stay within a few ulps of a plain double-precision reference.
// Used to check the NEON variant under qemu-aarch64 (scripts/check_neon.sh);
// on x86 the Python tests cover the same ground against torch.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "infinity_native.h"

namespace {

uint32_t rng_state = 12345;
float frand() {  // uniform in [-1, 1)
  rng_state = rng_state * 1664525u + 1013904223u;
  return static_cast<float>((rng_state >> 8) & 0xFFFFFF) / 8388608.0f - 1.0f;
}

uint16_t to_bf16_trunc(float f) { uint32_t u; memcpy(&u, &f, 4); return static_cast<uint16_t>(u >> 16); }

struct Problem {
  std::vector<float> p, m, v;
  std::vector<uint8_t> g, out;
};

Problem make(int64_t n, int gdt, int odt) {
  Problem pr;
  pr.p.resize(n); pr.m.resize(n); pr.v.resize(n);
  const int gsz = gdt == INF_DT_F32 ? 4 : 2;
  const int osz = odt == INF_DT_NONE ? 0 : (odt == INF_DT_F32 ? 4 : 2);
  pr.g.resize(n * gsz + 1); pr.out.resize(n * osz + 1);
  for (int64_t i = 0; i < n; ++i) {
    pr.p[i] = frand() * 3.0f;
    pr.m[i] = frand() * 0.1f;
    pr.v[i] = fabsf(frand()) * 0.01f;
    const float gi = frand();
    if (gdt == INF_DT_F32) memcpy(&pr.g[i * 4], &gi, 4);
    else if (gdt == INF_DT_BF16) { uint16_t h = to_bf16_trunc(gi); memcpy(&pr.g[i * 2], &h, 2); }
    else { uint16_t h = 0x3C00 ^ static_cast<uint16_t>((rng_state >> 3) & 0x03FF); memcpy(&pr.g[i * 2], &h, 2); }
  }
  return pr;
}

int run(int isa, Problem& pr, int64_t n, int gdt, int odt, int adamw, int threads) {
  int64_t ptrs[5] = {reinterpret_cast<int64_t>(pr.p.data()), reinterpret_cast<int64_t>(pr.g.data()),
                     reinterpret_cast<int64_t>(pr.m.data()), reinterpret_cast<int64_t>(pr.v.data()),
                     odt == INF_DT_NONE ? 0 : reinterpret_cast<int64_t>(pr.out.data())};
  int rc = 0;
  for (int step = 1; step <= 3 && rc == 0; ++step) {
    inf_adam_hparams hp{};
    hp.lr = 3e-3; hp.beta1 = 0.9; hp.beta2 = 0.999; hp.eps = 1e-8; hp.weight_decay = 0.1;
    hp.bias_correction1 = 1 - pow(0.9, step); hp.bias_correction2 = 1 - pow(0.999, step);
    hp.grad_scale = 1.0; hp.adamw_mode = adamw; hp.num_threads = threads;
    rc = inf_adam_step(isa, 1, ptrs, &n, gdt, odt, &hp);
  }
  return rc;
}

// Plain double-precision AdamW of the same three steps (fp32 grads only).
double max_rel_err_vs_double(int64_t n) {
  Problem a = make(n, INF_DT_F32, INF_DT_NONE);
  std::vector<double> p(a.p.begin(), a.p.end()), m(a.m.begin(), a.m.end()), v(a.v.begin(), a.v.end());
  std::vector<float> g(n);
  memcpy(g.data(), a.g.data(), n * 4);
  for (int step = 1; step <= 3; ++step) {
    const double bc1 = 1 - pow(0.9, step), bc2 = 1 - pow(0.999, step);
    for (int64_t i = 0; i < n; ++i) {
      p[i] *= 1 - 3e-3 * 0.1;
      m[i] = 0.9 * m[i] + 0.1 * g[i];
      v[i] = 0.999 * v[i] + 0.001 * g[i] * static_cast<double>(g[i]);
      p[i] -= 3e-3 / bc1 * m[i] / (sqrt(v[i]) / sqrt(bc2) + 1e-8);
    }
  }
  if (run(INF_ISA_SCALAR, a, n, INF_DT_F32, INF_DT_NONE, 1, 1) != 0) return 1e9;
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double e = fabs(a.p[i] - p[i]) / (fabs(p[i]) + 1e-3);
    if (e > worst) worst = e;
  }
  return worst;
}

// bf16 and 8-bit moments (inf_adam_step_moments): three steps from a state of
// zeros and random codes; every ISA must store the scalar variant's bytes.
struct LowbitState {
  std::vector<float> p, ms, vs;
  std::vector<uint8_t> g, m, v, out;
};

LowbitState make_lowbit(int64_t n, int mdt) {
  LowbitState s;
  const int msz = mdt == INF_DT_I8 ? 1 : 2;
  const int64_t nb = (n + INF_QBLOCK - 1) / INF_QBLOCK;
  s.p.resize(n); s.ms.resize(nb); s.vs.resize(nb);
  s.g.resize(n * 2 + 1); s.m.resize(n * msz + 1); s.v.resize(n * msz + 1); s.out.resize(n * 2 + 1);
  for (int64_t i = 0; i < n; ++i) {
    s.p[i] = frand();
    const uint16_t h = to_bf16_trunc(frand());
    memcpy(&s.g[i * 2], &h, 2);
    if (mdt == INF_DT_I8) {
      s.m[i] = static_cast<uint8_t>((rng_state >> 9) % 121 | ((rng_state >> 20) & 0x80));
      s.v[i] = static_cast<uint8_t>((rng_state >> 11) % 241);
    } else {
      const uint16_t a = to_bf16_trunc(frand() * 0.1f), b = to_bf16_trunc(fabsf(frand()) * 0.01f);
      memcpy(&s.m[i * 2], &a, 2);
      memcpy(&s.v[i * 2], &b, 2);
    }
  }
  for (int64_t b = 0; b < nb; ++b) { s.ms[b] = 0.1f; s.vs[b] = 0.1f; }
  return s;
}

int run_lowbit(int isa, LowbitState& s, int64_t n, int mdt, int adamw, int threads) {
  int64_t ptrs[7] = {reinterpret_cast<int64_t>(s.p.data()), reinterpret_cast<int64_t>(s.g.data()),
                     reinterpret_cast<int64_t>(s.m.data()), reinterpret_cast<int64_t>(s.v.data()),
                     reinterpret_cast<int64_t>(s.out.data()), reinterpret_cast<int64_t>(s.ms.data()),
                     reinterpret_cast<int64_t>(s.vs.data())};
  int rc = 0;
  for (int step = 1; step <= 3 && rc == 0; ++step) {
    inf_adam_hparams hp{};
    hp.lr = 3e-3; hp.beta1 = 0.9; hp.beta2 = 0.999; hp.eps = 1e-8; hp.weight_decay = 0.1;
    hp.bias_correction1 = 1 - pow(0.9, step); hp.bias_correction2 = 1 - pow(0.999, step);
    hp.grad_scale = 1.0; hp.adamw_mode = adamw; hp.num_threads = threads;
    rc = inf_adam_step_moments(isa, 1, ptrs, &n, INF_DT_BF16, INF_DT_BF16, mdt, &hp);
  }
  return rc;
}

int check_lowbit(int isa, const char* name) {
  const int64_t sizes[] = {1, 15, 17, 255, 257, 4097, 65541, (1 << 18) + 3};
  int failures = 0, checked = 0;
  for (int64_t n : sizes)
    for (int mdt : {INF_DT_BF16, INF_DT_I8})
      for (int adamw = 0; adamw < 2; ++adamw) {
        rng_state = 999;
        LowbitState a = make_lowbit(n, mdt);
        rng_state = 999;
        LowbitState b = make_lowbit(n, mdt);
        if (run_lowbit(INF_ISA_SCALAR, a, n, mdt, adamw, 1) || run_lowbit(isa, b, n, mdt, adamw, 3)) {
          printf("FAIL %s low-bit moments: kernel returned an error\n", name);
          ++failures;
          continue;
        }
        if (!(a.p == b.p && a.m == b.m && a.v == b.v && a.out == b.out && a.ms == b.ms && a.vs == b.vs)) {
          printf("FAIL %s n=%lld mdt=%d adamw=%d: low-bit moments differ from scalar\n", name,
                 static_cast<long long>(n), mdt, adamw);
          ++failures;
        }
        ++checked;
      }
  printf("%s low-bit moments: %d cases bit-identical to scalar\n", name, checked);
  return failures;
}

}  // namespace

int main() {
  const uint32_t ok = inf_isa_compiled() & inf_isa_supported();
  const char* names[] = {"scalar", "avx2", "avx512", "neon"};
  printf("build: %s\nbest: %s\n", inf_build_info(), names[inf_isa_best()]);
  int failures = 0;
  const int64_t sizes[] = {1, 15, 16, 17, 31, 33, 4097, 65541, (1 << 20) + 3};
  const int gdts[] = {INF_DT_F32, INF_DT_BF16, INF_DT_F16};
  const int odts[] = {INF_DT_NONE, INF_DT_BF16, INF_DT_F16, INF_DT_F32};
  for (int isa = 1; isa < INF_ISA_COUNT; ++isa) {
    if (!(ok & (1u << isa))) continue;
    int checked = 0;
    for (int64_t n : sizes)
      for (int gdt : gdts)
        for (int odt : odts)
          for (int adamw = 0; adamw < 2; ++adamw) {
            rng_state = 777;
            Problem a = make(n, gdt, odt);
            rng_state = 777;
            Problem b = make(n, gdt, odt);
            if (run(INF_ISA_SCALAR, a, n, gdt, odt, adamw, 1) || run(isa, b, n, gdt, odt, adamw, 2)) {
              printf("FAIL %s: kernel returned an error\n", names[isa]);
              ++failures;
              continue;
            }
            const bool same = a.p == b.p && a.m == b.m && a.v == b.v && a.out == b.out;
            if (!same) {
              printf("FAIL %s n=%lld gdt=%d odt=%d adamw=%d: differs from scalar\n", names[isa],
                     static_cast<long long>(n), gdt, odt, adamw);
              ++failures;
            }
            ++checked;
          }
    printf("%s: %d cases bit-identical to scalar\n", names[isa], checked);
    failures += check_lowbit(isa, names[isa]);
  }
  const double err = max_rel_err_vs_double(100003);
  printf("scalar vs double reference: max relative error %.3g\n", err);
  if (!(err < 1e-5)) {
    printf("FAIL scalar differs from the double-precision reference\n");
    ++failures;
  }
  int64_t bad_ptrs[5] = {0, 0, 0, 0, 0};
  int64_t one = 1;
  inf_adam_hparams hp{};
  if (inf_adam_step(-1, 1, bad_ptrs, &one, INF_DT_F32, INF_DT_NONE, &hp) != INF_E_INVAL) {
    printf("FAIL null pointers not refused\n");
    ++failures;
  }
  printf(failures ? "%d FAILED\n" : "all passed\n", failures);
  return failures ? 1 : 0;
}
