// The thread backend of the I/O engine: queue_depth threads, each claiming
// one block at a time from the engine's schedule and moving it with
// pread/pwrite. Used when io_uring_setup fails (old kernel, seccomp,
// kernel.io_uring_disabled) or when asked for.
#include <errno.h>
#include <unistd.h>

#include <thread>

#include "io_block.h"
#include "io_engine.h"

namespace infinity_native {
namespace io {

namespace {

// Moves one block to its end by pread/pwrite, with its staging and
// checksums; 0 or the block's error, with `msg`.
// See [Note: every completion is checked] (io_block.h).
int run_block_sync(Block* b, std::string& msg) {
  if (b->fault_err) {
    msg = fmt_error(*b, b->fault_err) + " [injected fault]";
    return -b->fault_err;
  }
  pre(b);
  Request* r = b->r;
  const int fd = r->file->fd;
  while (b->done_bytes < b->len) {
    int64_t want = next_len(b);
    off_t off = static_cast<off_t>(r->offset + b->rel + b->done_bytes);
    ssize_t k = r->op == INF_IO_READ ? pread(fd, b->mem + b->done_bytes, static_cast<size_t>(want), off)
                                     : pwrite(fd, b->mem + b->done_bytes, static_cast<size_t>(want), off);
    if (k < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      msg = fmt_error(*b, e);
      return -e;
    }
    if (k == 0) return zero_transfer_error(*b, msg);
    b->done_bytes += k;
  }
  return post(b, msg);
}

class ThreadsBackend final : public Backend {
 public:
  explicit ThreadsBackend(inf_io_engine* eng) : eng_(eng) {
    for (int i = 0; i < eng->qd; i++) workers_.emplace_back([this] { worker_main(); });
  }
  // Submissions notify the engine's cv_work themselves.
  void wake() override {}
  void join() override {
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

 private:
  void worker_main() {
    inf_io_engine& e = *eng_;
    std::unique_lock<std::mutex> lk(e.mu);
    for (;;) {
      Block* b = nullptr;
      e.cv_work.wait(lk, [&] { return e.stopping || (b = e.claim()) != nullptr; });
      if (!b) return;  // stopping and nothing to do
      lk.unlock();
      std::string msg;
      int err = run_block_sync(b, msg);
      lk.lock();
      e.finish(b, err, std::move(msg));
      // A freed bounce slot or a finished request can make work claimable.
      e.cv_work.notify_all();
    }
  }

  inf_io_engine* eng_;
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<Backend> start_threads(inf_io_engine* eng) { return std::make_unique<ThreadsBackend>(eng); }

}  // namespace io
}  // namespace infinity_native
