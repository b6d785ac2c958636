// Requests and blocks of the asynchronous I/O engine: what the scheduler
// (io_engine.cpp), the block work (io_block.cpp) and the two backends
// (io_uring.cpp, io_threads.cpp) share. See native/include/infinity_io.h for
// the contract and docs/io.md for the design.
#pragma once
#include <stdint.h>
#include <sys/uio.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "infinity_io.h"

namespace infinity_native {
namespace io {

constexpr int64_t kAlign = INF_IO_ALIGN;
inline int64_t round_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
inline int64_t round_down(int64_t n) { return n / kAlign * kAlign; }

// Staged (bounce) writes move blocks of at most this many bytes, whatever
// the engine's block size; see [Note: staged copies go through the cache piece by piece]
// (io_block.cpp).
constexpr int64_t kStageBlock = 256 << 10;
// Staged reads move blocks of at most this many bytes (a multiple of
// kStageBlock, so checksum chunks never straddle them); see [Note: staged read blocks]
// (io_block.cpp).
constexpr int64_t kStageReadBlock = 1 << 20;

// Bytes per block of a staged request of this op on an engine with this block size.
inline int64_t stage_block_for(int32_t op, int64_t block_size) {
  return std::min(block_size, op == INF_IO_READ ? kStageReadBlock : kStageBlock);
}

// Checksum chunk of an engine with this block size: the largest power of two
// dividing both it and kStageBlock, so that a chunk never straddles a block,
// staged or not, and the checksum list of a key does not depend on whether
// its bytes were staged.
inline int64_t chunk_bytes_for(int64_t block_size) {
  int64_t c = kStageBlock;
  while (block_size % c) c /= 2;
  return c;
}

struct File {
  int fd;
  std::string path;
};

struct Request {
  int64_t ticket = 0;
  int op = 0;
  std::shared_ptr<File> file;
  int64_t offset = 0;      // file offset of byte 0
  unsigned char* buf = nullptr;
  int64_t nbytes = 0;      // logical bytes
  int64_t padded = 0;      // bytes moved to/from the file (4 KiB multiple)
  int64_t aligned = 0;     // nbytes rounded down to 4 KiB: end of the body chunks
  unsigned char* bounce = nullptr;
  int64_t slot_bytes = 0;
  std::vector<int> free_slots;
  uint32_t* crcs = nullptr;
  int64_t chunk = 0;       // checksum chunk bytes: the engine's chunk_bytes_for(block size)
  bool verify = false;     // a read checks crcs[]
  bool given = false;      // a write's crcs[] came from the producer: nothing to compute
  int64_t block = 0;       // bytes per block: the engine's, or stage_block_for(op, it) when staged
  int64_t nblocks = 0;
  int64_t next_block = 0;  // next block to dispatch
  int inflight = 0;
  int err = 0;
  std::string msg;
  bool done = false;
};

struct Block {
  Request* r;
  int64_t index;
  int64_t rel;             // offset within the request
  int64_t len;             // bytes to transfer (4 KiB multiple unless the file is buffered)
  unsigned char* mem;      // where the bytes go/come from (user buffer or bounce slot)
  int slot;                // bounce slot, -1 in direct mode
  int64_t done_bytes = 0;
  bool fault_short = false;
  int fault_err = 0;
  bool crc_done = false;   // write checksums taken (while the block was in flight) or given
  struct iovec iov;        // io_uring READV/WRITEV argument; must outlive the SQE
};

}  // namespace io
}  // namespace infinity_native
