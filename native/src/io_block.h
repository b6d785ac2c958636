// Work on one block of a request outside the engine's lock, shared by both
// backends: staging copies, CRC32C per checksum chunk, the length of the next
// syscall and the messages of failed transfers.
//
// [Note: every completion is checked]
// The reference system counted completions and compared the total with what
// it submitted, so a full disk showed up later as a size mismatch far from its
// cause. Here each block's result is inspected: res < 0 fails the request with
// that errno, res == 0 on a read is end-of-file (never zero-filled), and a
// short transfer is re-issued for the rest until the block is complete.
#pragma once
#include <stdint.h>

#include <string>

#include "io_request.h"

namespace infinity_native {
namespace io {

// Message of a failed block: with `what`, "<op> of ... <what>"; else "<op> of
// ... failed after N bytes: <strerror(err)> (errno err)". Both name the path,
// the offset, the bytes and the request.
std::string fmt_error(const Block& b, int err, const char* what = nullptr);

// A transfer of the block returned 0 bytes: end of file for a read
// (INF_IO_E_EOF), -EIO for a write; `msg` says which.
int zero_transfer_error(const Block& b, std::string& msg);

// Length of the next syscall of a block (the injected short transfer takes half).
inline int64_t next_len(const Block* b) {
  int64_t want = b->len - b->done_bytes;
  if (b->fault_short && b->done_bytes == 0 && want >= 2 * kAlign) {
    want = round_down(want / 2);
  }
  return want;
}

// Before a write: stage the user's bytes into the bounce slot (zero
// padding), taking the checksums on the way.
void pre(Block* b);

// Checksums of a direct write block: the bytes do not change while the
// block is in flight, so the io_uring thread takes them right after
// submitting it, overlapping the transfer, instead of delaying the next
// submissions. (Staged blocks took theirs in pre().)
void write_crcs(Block* b);

// After a complete transfer: checksums (verified for reads) and the
// copy-out of staged reads, fused piece by piece. 0, or INF_IO_E_CHECKSUM
// with `msg` naming the chunk.
int post(Block* b, std::string& msg);

}  // namespace io
}  // namespace infinity_native
