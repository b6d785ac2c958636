// The io_uring backend of the I/O engine: one ring per CPU, each owned by one
// thread that claims blocks from the engine's schedule, submits them, reaps
// their completions, takes checksums and staging copies, and reports them.
// The rings themselves (raw syscalls, no liburing) are uring_ring.cpp.
//
// [Note: one ring per CPU]
// The thread that submits an O_DIRECT request does the kernel's work of
// building it (pinning user pages, building bios), and here the engine thread
// also computes checksums and staging copies. One ring and one thread reached
// only ~80% of what a pread/pwrite pool got from the same disk on 2 vCPUs, so
// the engine runs one ring per CPU (at most queue_depth), each with its own
// thread and share of the queue depth, all claiming blocks from one schedule.
//
// [Note: a dead ring]
// io_uring_enter failing with anything but EINTR, EAGAIN or EBUSY means the
// ring cannot take or wait for work any more. Its worker then fails every
// block that is its to report, with that errno, so waiters get an error
// instead of hanging while the loop spins: the SQEs the kernel has not taken
// are withdrawn and their blocks fail; blocks it claims later fail at once;
// blocks already at the disk are still reaped from the completion ring (it is
// shared memory), waited for with poll(2) on the ring's fd, since their
// memory may be in use by the kernel until they complete.
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <thread>
#include <utility>

#include "io_block.h"
#include "io_engine.h"
#include "uring_ring.h"

namespace infinity_native {
namespace io {

namespace {

// One ring and the thread that owns it. See [Note: one ring per CPU].
struct UringWorker {
  Ring ring;
  int evfd = -1;
  int limit = 1;  // blocks this ring keeps in flight
  std::thread th;
  // The loop's state, touched by th alone.
  bool need_poll = true;                         // the eventfd poll is to be (re)armed
  int dead = 0;                                  // errno of a failed io_uring_enter ([Note: a dead ring])
  int io_inflight = 0;                           // blocks of this ring at the disk
  std::vector<std::pair<Block*, int>> finished;  // block, error: to post and report
  std::vector<std::string> msgs;                 // their messages
  std::vector<Block*> fresh;                     // blocks just claimed
};

class UringBackend final : public Backend {
 public:
  explicit UringBackend(inf_io_engine* eng) : eng_(eng) {}
  int open();
  void run();
  void wake() override;
  void join() override;

 private:
  void close_rings();
  void uring_main(UringWorker* w);
  bool dispatch(UringWorker* w);
  bool launch(UringWorker* w, Block* b, bool now);
  int ring_enter(Ring& ring, unsigned to_submit, unsigned min_complete, unsigned flags);
  void submit_pending(Ring& ring);
  void enter(UringWorker* w);
  void fail_withdrawn(UringWorker* w);
  void reap(UringWorker* w);
  void reap_one(UringWorker* w, const io_uring_cqe& cqe);
  void complete(UringWorker* w);

  inf_io_engine* eng_;
  std::vector<std::unique_ptr<UringWorker>> urings_;
};

// ---- rings and their threads ----------------------------------------------------

// Sets up min(queue depth, CPUs) rings, each with its eventfd and share of
// the queue depth: 0, or -errno with every ring closed again.
int UringBackend::open() {
  const int qd = eng_->qd;
  const int ncpu = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const int nrings = std::min(qd, ncpu);
  int rc = 0;
  for (int i = 0; i < nrings && rc == 0; i++) {
    auto w = std::make_unique<UringWorker>();
    w->limit = qd / nrings + (i < qd % nrings ? 1 : 0);
    rc = w->ring.setup(static_cast<unsigned>(w->limit + 1));
    if (rc == 0) {
      // Non-blocking: a dead ring's poll(2) and the ring's poll SQE may both
      // see one wake-up; the second read must not block.
      w->evfd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
      if (w->evfd < 0) {
        rc = -errno;
        w->ring.close_all();
      }
    }
    if (rc == 0) urings_.push_back(std::move(w));
  }
  if (rc) close_rings();
  return rc;
}

void UringBackend::run() {
  for (auto& w : urings_) {
    UringWorker* wp = w.get();
    w->th = std::thread([this, wp] { uring_main(wp); });
  }
}

void UringBackend::wake() {
  for (auto& w : urings_) {
    uint64_t one = 1;
    ssize_t k = write(w->evfd, &one, sizeof one);
    (void)k;
  }
}

void UringBackend::join() {
  for (auto& w : urings_) {
    if (w->th.joinable()) w->th.join();
  }
  close_rings();
}

void UringBackend::close_rings() {
  for (auto& w : urings_) {
    w->ring.close_all();
    if (w->evfd >= 0) close(w->evfd);
  }
  urings_.clear();
}

// ---- submission -------------------------------------------------------------------

bool arm_poll(UringWorker* w) {
  io_uring_sqe* sqe = w->ring.get_sqe();
  if (!sqe) return false;
  sqe->opcode = IORING_OP_POLL_ADD;
  sqe->fd = w->evfd;
  sqe->poll32_events = POLLIN;
  sqe->user_data = 0;  // 0 marks the wake-up poll; blocks carry their pointer
  return true;
}

void prep_sqe(Ring& ring, Block* b) {
  io_uring_sqe* sqe = ring.get_sqe();  // never null: in flight <= qd < entries
  Request* r = b->r;
  int64_t want = next_len(b);
  b->iov.iov_base = b->mem + b->done_bytes;
  b->iov.iov_len = static_cast<size_t>(want);
  sqe->opcode = r->op == INF_IO_READ ? IORING_OP_READV : IORING_OP_WRITEV;
  sqe->fd = r->file->fd;
  sqe->off = static_cast<uint64_t>(r->offset + b->rel + b->done_bytes);
  sqe->addr = reinterpret_cast<uint64_t>(&b->iov);
  sqe->len = 1;
  sqe->user_data = reinterpret_cast<uint64_t>(b);
}

// A block ended (err 0 when complete): to be posted and reported.
void ended(UringWorker* w, Block* b, int err, std::string&& msg) {
  w->finished.emplace_back(b, err);
  w->msgs.push_back(std::move(msg));
}

// A block failed because its ring is dead ([Note: a dead ring]).
void ended_dead(UringWorker* w, Block* b) {
  ended(w, b, -w->dead, fmt_error(*b, w->dead) + " [io_uring_enter failed: the ring is unusable]");
}

// io_uring_enter, or the failure an INF_IO_FAULT_RING fault injects (tests).
int UringBackend::ring_enter(Ring& ring, unsigned to_submit, unsigned min_complete, unsigned flags) {
  const int injected = eng_->ring_fault.load(std::memory_order_relaxed);
  if (injected) {
    errno = injected;
    return -1;
  }
  return sys_uring_enter(ring.fd, to_submit, min_complete, flags);
}

// Submits the SQEs queued in the ring without waiting for completions
// (a failure is left for enter() to see).
void UringBackend::submit_pending(Ring& ring) {
  if (!ring.pending) return;
  int k = ring_enter(ring, ring.pending, 0, 0);
  if (k > 0) ring.pending -= std::min<unsigned>(ring.pending, static_cast<unsigned>(k));
}

// Starts a claimed block: an injected fault joins `finished` (reported with
// the next completions); else the block is staged, queued and, with `now`,
// submitted at once. True if it went to the disk.
bool UringBackend::launch(UringWorker* w, Block* b, bool now) {
  if (w->dead) {
    ended_dead(w, b);
    return false;
  }
  if (b->fault_err) {
    ended(w, b, -b->fault_err, fmt_error(*b, b->fault_err) + " [injected fault]");
    return false;
  }
  pre(b);
  prep_sqe(w->ring, b);
  w->io_inflight++;
  if (now) submit_pending(w->ring);
  return true;
}

// Claims blocks up to this ring's share of the queue depth and sends them
// to the disk; direct writes then take their checksums, overlapping the
// transfer. True when the engine is stopping and has nothing left.
bool UringBackend::dispatch(UringWorker* w) {
  std::vector<Block*>& fresh = w->fresh;
  fresh.clear();
  {
    std::lock_guard<std::mutex> lk(eng_->mu);
    while (w->io_inflight + static_cast<int>(fresh.size()) < w->limit) {
      Block* b = eng_->claim();
      if (!b) break;
      fresh.push_back(b);
    }
    if (eng_->stopping && eng_->active.empty() && eng_->inflight == 0) return true;
  }
  // A staged write goes out as soon as it is copied, so the disk works
  // while the next block is staged (else it idles for the whole batch).
  for (Block* b : fresh) launch(w, b, b->slot >= 0 && b->r->op == INF_IO_WRITE);
  submit_pending(w->ring);
  for (Block* b : fresh) {
    if (!b->fault_err && !w->dead) write_crcs(b);
  }
  return false;
}

// ---- completion -------------------------------------------------------------------

// Submits, and blocks for at least one completion unless some blocks are
// already finished (injected faults) and must be reported. A dead ring
// fails what it cannot submit and waits with poll(2) ([Note: a dead ring]).
void UringBackend::enter(UringWorker* w) {
  Ring& ring = w->ring;
  if (!w->dead) {
    unsigned wait_for = w->finished.empty() ? 1 : 0;
    int rc = ring_enter(ring, ring.pending, wait_for, IORING_ENTER_GETEVENTS);
    if (rc >= 0) {
      ring.pending -= std::min<unsigned>(ring.pending, static_cast<unsigned>(rc));
      return;
    }
    if (errno == EINTR || errno == EAGAIN || errno == EBUSY) return;
    w->dead = errno;
    fprintf(stderr, "infinity io_uring: io_uring_enter failed: %s (errno %d); this ring's blocks fail from now on\n",
            strerror(w->dead), w->dead);
  }
  fail_withdrawn(w);
  if (!w->finished.empty()) return;
  // Wake-ups (new work, stop) on the eventfd; completions of blocks at the
  // disk on the ring's fd. The timeout only bounds a missed wake-up.
  pollfd fds[2] = {{w->evfd, POLLIN, 0}, {ring.fd, POLLIN, 0}};
  if (poll(fds, w->io_inflight > 0 ? 2 : 1, 100) > 0 && (fds[0].revents & POLLIN)) {
    uint64_t v;
    ssize_t k = read(w->evfd, &v, sizeof v);
    (void)k;
  }
}

// A dead ring: the SQEs the kernel has not taken (new blocks, retries,
// the rest of short transfers) are withdrawn and their blocks fail. Only
// this thread and io_uring_enter touch the submission ring (no SQPOLL), so
// moving its tail back is safe.
void UringBackend::fail_withdrawn(UringWorker* w) {
  Ring& ring = w->ring;
  const unsigned head = __atomic_load_n(ring.sq_head, __ATOMIC_ACQUIRE);
  const unsigned tail = *ring.sq_tail;
  for (unsigned i = head; i != tail; i++) {
    const io_uring_sqe& sqe = ring.sqes[ring.sq_array[i & *ring.sq_mask]];
    if (sqe.user_data == 0) continue;  // the wake-up poll
    w->io_inflight--;
    ended_dead(w, reinterpret_cast<Block*>(sqe.user_data));
  }
  __atomic_store_n(ring.sq_tail, head, __ATOMIC_RELEASE);
  ring.pending = 0;
}

// Takes every completion the ring holds.
void UringBackend::reap(UringWorker* w) {
  Ring& ring = w->ring;
  unsigned head = *ring.cq_head;
  unsigned tail = __atomic_load_n(ring.cq_tail, __ATOMIC_ACQUIRE);
  for (; head != tail; head++) reap_one(w, ring.cqes[head & *ring.cq_mask]);
  __atomic_store_n(ring.cq_head, head, __ATOMIC_RELEASE);
}

// One completion: the wake-up poll, a retry, the rest of a short transfer,
// or a block that ended (complete or failed).
// See [Note: every completion is checked] (io_block.h).
void UringBackend::reap_one(UringWorker* w, const io_uring_cqe& cqe) {
  if (cqe.user_data == 0) {
    uint64_t v;
    ssize_t k = read(w->evfd, &v, sizeof v);
    (void)k;
    w->need_poll = true;
    return;
  }
  auto* b = reinterpret_cast<Block*>(cqe.user_data);
  int res = cqe.res;
  if (res == -EINTR || res == -EAGAIN) {
    prep_sqe(w->ring, b);  // retry the same range
    return;
  }
  if (res < 0) {
    w->io_inflight--;
    ended(w, b, res, fmt_error(*b, -res));
    return;
  }
  if (res == 0) {
    w->io_inflight--;
    std::string msg;
    int err = zero_transfer_error(*b, msg);
    ended(w, b, err, std::move(msg));
    return;
  }
  b->done_bytes += res;
  if (b->done_bytes < b->len) {
    prep_sqe(w->ring, b);  // short transfer: continue where it stopped
    return;
  }
  w->io_inflight--;
  ended(w, b, 0, std::string());
}

// Checksums and copies, then completion. A staged block's slot is refilled
// as soon as it is free, so the disk is not left idle while the copies of a
// whole batch of completions run.
void UringBackend::complete(UringWorker* w) {
  auto& finished = w->finished;
  auto& msgs = w->msgs;
  for (size_t i = 0; i < finished.size(); i++) {
    Block* b = finished[i].first;
    const bool staged = b->slot >= 0;
    if (finished[i].second == 0) finished[i].second = post(b, msgs[i]);
    Block* next = nullptr;
    {
      std::lock_guard<std::mutex> lk(eng_->mu);
      eng_->finish(b, finished[i].second, std::move(msgs[i]));
      if (staged && w->io_inflight < w->limit) next = eng_->claim();
    }
    if (next && launch(w, next, true)) write_crcs(next);
  }
  finished.clear();
  msgs.clear();
}

void UringBackend::uring_main(UringWorker* w) {
  for (;;) {
    // 1. Dispatch new blocks up to the queue depth.
    if (dispatch(w)) return;
    if (w->need_poll && !w->dead && arm_poll(w)) w->need_poll = false;
    // 2. Submit, and wait for completions.
    enter(w);
    // 3. Reap.
    reap(w);
    submit_pending(w->ring);  // resubmissions go out now so the disk stays busy during post()
    // Direct blocks need no slot: their successors go out before the
    // completed blocks' checksums are taken (reads were 0.91-0.95 of raw
    // when the ring refilled only after the whole batch's checksums).
    dispatch(w);
    // 4. Checksums and copies, then completion.
    complete(w);
  }
}

}  // namespace

int start_uring(inf_io_engine* eng, std::unique_ptr<Backend>* out) {
  auto be = std::make_unique<UringBackend>(eng);
  int rc = be->open();
  if (rc) return rc;
  be->run();
  *out = std::move(be);
  return 0;
}

}  // namespace io
}  // namespace infinity_native
