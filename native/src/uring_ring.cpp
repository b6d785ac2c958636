// One io_uring by raw syscalls; see uring_ring.h.
#include "uring_ring.h"

#include <errno.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>

namespace infinity_native {
namespace io {

namespace {

int sys_uring_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}

}  // namespace

int sys_uring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

int Ring::setup(unsigned entries) {
  io_uring_params p;
  memset(&p, 0, sizeof p);
  fd = sys_uring_setup(entries, &p);
  if (fd < 0) return -errno;
  sq_sz = p.sq_off.array + p.sq_entries * sizeof(unsigned);
  cq_sz = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
  const bool single = p.features & IORING_FEAT_SINGLE_MMAP;
  if (single) sq_sz = cq_sz = std::max(sq_sz, cq_sz);
  sq_ptr = mmap(nullptr, sq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
  if (sq_ptr == MAP_FAILED) return fail();
  if (single) {
    cq_ptr = sq_ptr;
  } else {
    cq_ptr = mmap(nullptr, cq_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
    if (cq_ptr == MAP_FAILED) return fail();
  }
  sqes_sz = p.sq_entries * sizeof(io_uring_sqe);
  void* s = mmap(nullptr, sqes_sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
  if (s == MAP_FAILED) return fail();
  sqes = static_cast<io_uring_sqe*>(s);
  auto* sq = static_cast<char*>(sq_ptr);
  auto* cq = static_cast<char*>(cq_ptr);
  sq_head = reinterpret_cast<unsigned*>(sq + p.sq_off.head);
  sq_tail = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
  sq_mask = reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
  sq_array = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
  cq_head = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
  cq_tail = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
  cq_mask = reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
  cqes = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
  sq_entries = p.sq_entries;
  return 0;
}

int Ring::fail() {
  int e = errno;
  close_all();
  return -e;
}

void Ring::close_all() {
  if (sqes && sqes != MAP_FAILED) munmap(sqes, sqes_sz);
  if (cq_ptr && cq_ptr != MAP_FAILED && cq_ptr != sq_ptr) munmap(cq_ptr, cq_sz);
  if (sq_ptr && sq_ptr != MAP_FAILED) munmap(sq_ptr, sq_sz);
  if (fd >= 0) close(fd);
  fd = -1;
  sqes = nullptr;
  sq_ptr = cq_ptr = nullptr;
}

}  // namespace io
}  // namespace infinity_native
