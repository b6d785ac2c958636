// The swap store's checksum chunk rule (docs/io.md, "Checksums"), shared by
// the I/O engine and the AdamW step that takes the sums of what it writes.
#pragma once
#include <stdint.h>

namespace infinity_native {

// Chunks of nbytes: one per `chunk` bytes of the 4 KiB-aligned body (from
// byte 0), plus one for an unaligned tail.
inline int64_t sum_chunk_count(int64_t nbytes, int64_t chunk) {
  if (nbytes <= 0) return 0;
  const int64_t aligned = nbytes / 4096 * 4096;
  return (aligned + chunk - 1) / chunk + (nbytes > aligned ? 1 : 0);
}

// Byte range [*a, *b) of chunk c of nbytes.
inline void sum_chunk_range(int64_t c, int64_t nbytes, int64_t chunk, int64_t* a, int64_t* b) {
  const int64_t aligned = nbytes / 4096 * 4096;
  if (c < (aligned + chunk - 1) / chunk) {
    *a = c * chunk;
    *b = aligned < (c + 1) * chunk ? aligned : (c + 1) * chunk;
  } else {
    *a = aligned;
    *b = nbytes;
  }
}

}  // namespace infinity_native
