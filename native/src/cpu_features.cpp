// CPU feature detection. Compiled with no ISA flags and no LTO (see
// CMakeLists.txt) so that it runs on any CPU of the architecture.
//
// A level counts as supported only if the CPU has the instructions AND the OS
// saves the matching register state on context switch (XCR0 via XGETBV);
// otherwise using ymm/zmm registers faults even though CPUID lists them.
#include "isa.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

namespace {

uint64_t read_xcr0() {
  uint32_t eax, edx;
  // xgetbv with ecx=0, spelled as bytes so no -mxsave is needed.
  __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

uint32_t detect() {
  uint32_t mask = 1u << INF_ISA_SCALAR;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return mask;
  const bool osxsave = c & (1u << 27);
  const bool avx = c & (1u << 28);
  const bool fma = c & (1u << 12);
  const bool f16c = c & (1u << 29);
  if (!osxsave) return mask;
  const uint64_t xcr0 = read_xcr0();
  const bool os_ymm = (xcr0 & 0x6) == 0x6;     // SSE + AVX state
  const bool os_zmm = (xcr0 & 0xe6) == 0xe6;   // + opmask, ZMM_Hi256, Hi16_ZMM
  if (__get_cpuid_max(0, nullptr) < 7) return mask;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = b & (1u << 5);
  const bool avx512f = b & (1u << 16);
  const bool avx512dq = b & (1u << 17);
  const bool avx512bw = b & (1u << 30);
  const bool avx512vl = b & (1u << 31);
  if (avx && avx2 && fma && f16c && os_ymm) mask |= 1u << INF_ISA_AVX2;
  if ((mask & (1u << INF_ISA_AVX2)) && avx512f && avx512dq && avx512bw && avx512vl && os_zmm)
    mask |= 1u << INF_ISA_AVX512;
  return mask;
}

}  // namespace

#elif defined(__aarch64__)
#include <sys/auxv.h>
#ifndef HWCAP_ASIMD
#define HWCAP_ASIMD (1 << 1)
#endif
namespace {
uint32_t detect() {
  uint32_t mask = 1u << INF_ISA_SCALAR;
  if (getauxval(AT_HWCAP) & HWCAP_ASIMD) mask |= 1u << INF_ISA_NEON;
  return mask;
}
}  // namespace
#else
namespace {
uint32_t detect() { return 1u << INF_ISA_SCALAR; }
}  // namespace
#endif

uint32_t inf_cpu_isa_mask() {
  static const uint32_t mask = detect();
  return mask;
}
