// One io_uring by raw syscalls (<linux/io_uring.h>, no liburing): setup and
// mapping of the submission and completion rings, SQEs, io_uring_enter.
// Used by the io_uring backend (io_uring.cpp).
#pragma once
#include <linux/io_uring.h>
#include <stddef.h>
#include <string.h>

namespace infinity_native {
namespace io {

int sys_uring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags);

struct Ring {
  int fd = -1;
  void* sq_ptr = nullptr;
  void* cq_ptr = nullptr;
  size_t sq_sz = 0, cq_sz = 0;
  io_uring_sqe* sqes = nullptr;
  size_t sqes_sz = 0;
  unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
  unsigned *cq_head, *cq_tail, *cq_mask;
  io_uring_cqe* cqes;
  unsigned sq_entries = 0;
  unsigned pending = 0;  // SQEs prepared but not yet passed to io_uring_enter

  // 0, or -errno (nothing left open).
  int setup(unsigned entries);
  void close_all();

  // Only the engine thread touches the ring, so plain loads of our own
  // indices are safe; the kernel's indices need acquire/release.
  io_uring_sqe* get_sqe() {
    unsigned tail = *sq_tail;
    unsigned head = __atomic_load_n(sq_head, __ATOMIC_ACQUIRE);
    if (tail - head >= sq_entries) return nullptr;
    unsigned idx = tail & *sq_mask;
    io_uring_sqe* sqe = &sqes[idx];
    memset(sqe, 0, sizeof *sqe);
    sq_array[idx] = idx;
    __atomic_store_n(sq_tail, tail + 1, __ATOMIC_RELEASE);
    pending++;
    return sqe;
  }

 private:
  int fail();
};

}  // namespace io
}  // namespace infinity_native
