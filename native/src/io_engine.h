// The asynchronous I/O engine behind native/include/infinity_io.h: one
// schedule of blocks over all requests (io_engine.cpp) and a backend that
// moves them, io_uring (io_uring.cpp) or a pread/pwrite thread pool
// (io_threads.cpp). docs/io.md describes the design.
#pragma once
#include <stdint.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "infinity_io.h"
#include "io_request.h"

namespace infinity_native {
namespace io {

// The threads that move blocks. They claim blocks from the engine's schedule
// (inf_io_engine::claim) and report each one (inf_io_engine::finish), both
// under the engine's lock, until the engine is stopping and has nothing left.
struct Backend {
  virtual ~Backend() = default;
  // New work may be claimable (called without the engine's lock).
  virtual void wake() = 0;
  // The engine is stopping (and woken): waits for the threads to exit and
  // releases what the backend holds.
  virtual void join() = 0;
};

// One ring per CPU (at most the queue depth) with its thread; 0, or -errno
// when the kernel refuses io_uring (nothing is left running then).
int start_uring(inf_io_engine* eng, std::unique_ptr<Backend>* out);
// queue_depth threads doing pread/pwrite.
std::unique_ptr<Backend> start_threads(inf_io_engine* eng);

}  // namespace io
}  // namespace infinity_native

struct inf_io_engine {
  using Block = infinity_native::io::Block;
  using Request = infinity_native::io::Request;
  using File = infinity_native::io::File;

  int backend = INF_IO_BACKEND_THREADS;
  int qd = 8;
  int64_t block = 8 << 20;
  int64_t chunk_bytes = infinity_native::io::kStageBlock;  // checksum chunk: chunk_bytes_for(block)

  std::mutex mu;
  std::condition_variable cv_work;  // thread backend: a block may be claimable
  std::condition_variable cv_done;  // a request completed
  std::deque<Request*> active;      // requests with blocks left to dispatch
  std::unordered_map<int64_t, Request*> tickets;
  std::vector<std::shared_ptr<File>> files;
  int64_t next_ticket = 1;
  int inflight = 0;
  bool stopping = false;

  // Fault injection (tests): see inf_io_set_fault.
  int fault_op = -1;
  int64_t fault_nth = 0;
  int fault_err = 0;
  int64_t fault_count = 0;
  // Set by an INF_IO_FAULT_RING fault: every io_uring_enter fails with this errno.
  std::atomic<int> ring_fault{0};

  std::unique_ptr<infinity_native::io::Backend> impl;

  // ---- shared scheduling (call with mu held) ------------------------------

  // The next block of the first request that has one to give (and, when
  // staged, a free bounce slot for it), or null.
  Block* claim();
  // Reports a block (err 0, -errno or INF_IO_E_*) and frees it; completes its
  // request when it was the last one in flight and none is left to dispatch.
  void finish(Block* b, int err, std::string&& msg);

  // ---- lifecycle ----------------------------------------------------------

  int start(int want_backend);
  void stop();
};
