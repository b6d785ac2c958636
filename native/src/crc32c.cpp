// CRC32C (Castagnoli): portable slicing-by-8 tables, run-time choice of the
// SSE4.2 path, and the zero-shift operators that let the hardware path run
// three independent streams (one crc32 instruction has a 3-cycle latency but
// a throughput of one per cycle). Method after Mark Adler's crc32c.c.
//
// Compiled without ISA flags: only crc32c_sse42.cpp carries -msse4.2, and it
// is entered only after CPUID says the instruction exists.
#include <atomic>
#include <mutex>

#include "crc32c.h"
#include "infinity_io.h"
#include "isa.h"

namespace infinity_native {
namespace crc {

namespace {
constexpr uint32_t kPoly = 0x82f63b78u;  // reflected Castagnoli polynomial
uint32_t g_table[8][256];
std::once_flag g_once;
std::atomic<int> g_force_sw{0};
bool g_have_sse42 = false;
bool g_have_vpclmul = false;  // AVX-512 usable (CPUID + XCR0) and VPCLMULQDQ

uint32_t gf2_times(const uint32_t* mat, uint32_t vec) {
  uint32_t sum = 0;
  while (vec) {
    if (vec & 1) sum ^= *mat;
    vec >>= 1;
    mat++;
  }
  return sum;
}

void gf2_square(uint32_t* sq, const uint32_t* mat) {
  for (int n = 0; n < 32; n++) sq[n] = gf2_times(mat, mat[n]);
}

// Operator (32x32 GF(2) matrix) that advances a raw CRC over len zero bytes.
void zeros_op(uint32_t* even, size_t len) {
  uint32_t odd[32];
  odd[0] = kPoly;  // one zero bit
  uint32_t row = 1;
  for (int n = 1; n < 32; n++) {
    odd[n] = row;
    row <<= 1;
  }
  gf2_square(even, odd);  // two zero bits
  gf2_square(odd, even);  // four zero bits
  // Each squaring doubles the count: odd is 4 bits = half a byte now, so the
  // next squaring yields one byte, and so on by the binary digits of len.
  do {
    gf2_square(even, odd);
    len >>= 1;
    if (len == 0) return;
    gf2_square(odd, even);
    len >>= 1;
  } while (len);
  for (int n = 0; n < 32; n++) even[n] = odd[n];
}

void zeros_table(uint32_t t[4][256], size_t len) {
  uint32_t op[32];
  zeros_op(op, len);
  for (uint32_t n = 0; n < 256; n++) {
    t[0][n] = gf2_times(op, n);
    t[1][n] = gf2_times(op, n << 8);
    t[2][n] = gf2_times(op, n << 16);
    t[3][n] = gf2_times(op, n << 24);
  }
}

void init() {
  for (uint32_t n = 0; n < 256; n++) {
    uint32_t c = n;
    for (int k = 0; k < 8; k++) c = c & 1 ? (c >> 1) ^ kPoly : c >> 1;
    g_table[0][n] = c;
  }
  for (uint32_t n = 0; n < 256; n++) {
    uint32_t c = g_table[0][n];
    for (int k = 1; k < 8; k++) {
      c = g_table[0][c & 0xff] ^ (c >> 8);
      g_table[k][n] = c;
    }
  }
  zeros_table(g_shift_long, kLong);
  zeros_table(g_shift_short, kShort);
#if defined(__x86_64__)
  __builtin_cpu_init();
  g_have_sse42 = __builtin_cpu_supports("sse4.2");
  g_have_vpclmul = g_have_sse42 && (inf_cpu_isa_mask() & (1u << INF_ISA_AVX512)) &&
                   __builtin_cpu_supports("vpclmulqdq");
#endif
}
}  // namespace

uint32_t g_shift_long[4][256];
uint32_t g_shift_short[4][256];

uint32_t update_sw(uint32_t crc, const unsigned char* p, size_t n) {
  while (n && (reinterpret_cast<uintptr_t>(p) & 7)) {
    crc = g_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
    n--;
  }
  while (n >= 8) {
    uint64_t w;
    __builtin_memcpy(&w, p, 8);  // little-endian hosts only (x86-64, aarch64)
    w ^= crc;
    crc = g_table[7][w & 0xff] ^ g_table[6][(w >> 8) & 0xff] ^ g_table[5][(w >> 16) & 0xff] ^
          g_table[4][(w >> 24) & 0xff] ^ g_table[3][(w >> 32) & 0xff] ^
          g_table[2][(w >> 40) & 0xff] ^ g_table[1][(w >> 48) & 0xff] ^ g_table[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) crc = g_table[0][(crc ^ *p++) & 0xff] ^ (crc >> 8);
  return crc;
}

}  // namespace crc
}  // namespace infinity_native

using namespace infinity_native::crc;

extern "C" INF_API uint32_t inf_crc32c(uint32_t crc, const void* data, int64_t nbytes) {
  std::call_once(g_once, init);
  if (nbytes <= 0 || data == nullptr) return crc;
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = ~crc;
#if defined(__x86_64__)
  const int force = g_force_sw.load(std::memory_order_relaxed);
  if (g_have_vpclmul && force == 0) return ~update_vpclmul(c, p, static_cast<size_t>(nbytes));
  if (g_have_sse42 && force != 1) return ~update_sse42(c, p, static_cast<size_t>(nbytes));
#endif
  return ~update_sw(c, p, static_cast<size_t>(nbytes));
}

extern "C" INF_API int32_t inf_crc32c_hw(void) {
  std::call_once(g_once, init);
  const int force = g_force_sw.load();
  if (g_have_vpclmul && force == 0) return 2;
  return g_have_sse42 && force != 1 ? 1 : 0;
}

extern "C" INF_API void inf_crc32c_force_sw(int32_t force) {
  std::call_once(g_once, init);
  g_force_sw.store(force == 1 || force == 2 ? force : 0);
}
