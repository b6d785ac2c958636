// Asynchronous block I/O engine: io_uring (raw syscalls) or a pread/pwrite
// thread pool. See native/include/infinity_io.h for the contract and
// docs/io.md for the design.
//
// [Note: every completion is checked]
// The reference system counted completions and compared the total with what
// it submitted, so a full disk showed up later as a size mismatch far from its
// cause. Here each block's result is inspected: res < 0 fails the request with
// that errno, res == 0 on a read is end-of-file (never zero-filled), and a
// short transfer is re-issued for the rest until the block is complete.
#include <errno.h>
#include <fcntl.h>
#include <linux/io_uring.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "chunk_rule.h"
#include "infinity_io.h"

namespace {

constexpr int64_t kAlign = INF_IO_ALIGN;
inline int64_t round_up(int64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
inline int64_t round_down(int64_t n) { return n / kAlign * kAlign; }

// Staged (bounce) writes move blocks of at most this many bytes, whatever
// the engine's block size; see [Note: staged copies go through the cache piece by piece].
constexpr int64_t kStageBlock = 256 << 10;
// Staged reads move blocks of at most this many bytes (a multiple of
// kStageBlock, so checksum chunks never straddle them); see [Note: staged read blocks].
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

const char* op_name(int op) { return op == INF_IO_WRITE ? "write" : "read"; }

std::string fmt_error(const Block& b, int err, const char* what = nullptr) {
  char buf[1024];
  const Request& r = *b.r;
  if (what) {
    snprintf(buf, sizeof buf, "%s of %lld bytes at offset %lld of '%s' %s (request: offset %lld, %lld bytes)",
             op_name(r.op), (long long)b.len, (long long)(r.offset + b.rel), r.file->path.c_str(), what,
             (long long)r.offset, (long long)r.nbytes);
  } else {
    snprintf(buf, sizeof buf,
             "%s of %lld bytes at offset %lld of '%s' failed after %lld bytes: %s (errno %d) "
             "(request: offset %lld, %lld bytes)",
             op_name(r.op), (long long)b.len, (long long)(r.offset + b.rel), r.file->path.c_str(),
             (long long)b.done_bytes, strerror(err), err, (long long)r.offset, (long long)r.nbytes);
  }
  return buf;
}

// ---- io_uring by raw syscalls (no liburing) --------------------------------

int sys_uring_setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}
int sys_uring_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

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

  int setup(unsigned entries) {
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
  int fail() {
    int e = errno;
    close_all();
    return -e;
  }
  void close_all() {
    if (sqes && sqes != MAP_FAILED) munmap(sqes, sqes_sz);
    if (cq_ptr && cq_ptr != MAP_FAILED && cq_ptr != sq_ptr) munmap(cq_ptr, cq_sz);
    if (sq_ptr && sq_ptr != MAP_FAILED) munmap(sq_ptr, sq_sz);
    if (fd >= 0) close(fd);
    fd = -1;
    sqes = nullptr;
    sq_ptr = cq_ptr = nullptr;
  }
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
};

// One ring and the thread that owns it. See [Note: one ring per CPU].
struct UringWorker {
  Ring ring;
  int evfd = -1;
  int limit = 1;  // blocks this ring keeps in flight
  std::thread th;
};

}  // namespace

// [Note: one ring per CPU]
// The thread that submits an O_DIRECT request does the kernel's work of
// building it (pinning user pages, building bios), and here the engine thread
// also computes checksums and staging copies. One ring and one thread reached
// only ~80% of what a pread/pwrite pool got from the same disk on 2 vCPUs, so
// the engine runs one ring per CPU (at most queue_depth), each with its own
// thread and share of the queue depth, all claiming blocks from one schedule.
struct inf_io_engine {
  int backend = INF_IO_BACKEND_THREADS;
  int qd = 8;
  int64_t block = 8 << 20;
  int64_t chunk_bytes = kStageBlock;  // checksum chunk: chunk_bytes_for(block)

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

  std::vector<std::thread> workers;
  std::vector<std::unique_ptr<UringWorker>> urings;

  // ---- shared scheduling (call with mu held) ------------------------------

  Block* claim() {
    for (auto it = active.begin(); it != active.end();) {
      Request* r = *it;
      if (r->err || r->next_block >= r->nblocks) {
        it = active.erase(it);
        continue;
      }
      if (r->bounce && r->free_slots.empty()) {
        ++it;
        continue;
      }
      auto* b = new Block();
      b->r = r;
      b->index = r->next_block++;
      b->rel = b->index * r->block;
      b->len = std::min(r->block, r->padded - b->rel);
      if (r->bounce) {
        b->slot = r->free_slots.back();
        r->free_slots.pop_back();
        b->mem = r->bounce + b->slot * r->slot_bytes;
      } else {
        b->slot = -1;
        b->mem = r->buf + b->rel;
      }
      b->crc_done = r->given;
      r->inflight++;
      inflight++;
      if (fault_nth > 0 && (fault_op < 0 || fault_op == r->op) && ++fault_count == fault_nth) {
        if (fault_err) b->fault_err = fault_err;
        else b->fault_short = true;
        fault_nth = 0;
      }
      if (r->next_block >= r->nblocks) active.erase(it);
      return b;
    }
    return nullptr;
  }

  void finish(Block* b, int err, std::string&& msg) {
    Request* r = b->r;
    if (b->slot >= 0) r->free_slots.push_back(b->slot);
    r->inflight--;
    inflight--;
    if (err && !r->err) {
      r->err = err;
      r->msg = std::move(msg);
    }
    if (r->inflight == 0 && (r->err || r->next_block >= r->nblocks)) {
      r->done = true;
      cv_done.notify_all();
    }
    delete b;
  }

  // ---- per-block work outside the lock -------------------------------------

  // [Note: staged copies go through the cache piece by piece]
  // Copying a staged block into its slot and then taking its checksum would
  // read it from DRAM twice, beside the disk's own DMA. So every block is
  // walked piece by piece, a piece being one checksum chunk (at most
  // kStageBlock bytes, L2-sized): a staged write sums
  // a piece of the source, which brings it into cache, and copies it into the
  // slot; a staged read sums a piece of the slot and copies it out while it
  // is hot. (Plain stores, not streaming ones, into the slot: the virtio disk
  // took 5-10% less from a slot written past the cache.) Staged writes
  // also use blocks of at most kStageBlock bytes, so the slots in flight stay
  // in cache, where the disk's DMA finds them: plain-tensor writes went from
  // 0.86-0.93 of direct writes with 1 MiB staged blocks to 0.82-1.10 (median
  // 1.01) with 256 KiB (128 KiB and less lose to per-request costs).
  //
  // [Note: staged read blocks]
  // Staged reads use larger blocks (kStageReadBlock). With 256 KiB blocks
  // they ran in two modes lasting minutes: at or above direct 8 MiB reads
  // into the pool, or at 0.87-0.89 of them, in every store at once. The slow
  // mode is not the copy-out: with the copy removed, staged reads still ran
  // at 0.87 of direct ones, and direct reads into the pool in 256 KiB blocks
  // at 0.92. With 1 MiB blocks the slow mode is gone (no 5-read window under
  // 0.9 of direct reads in 48, against 19 of 48 with 256 KiB, same minutes),
  // at the price of the fast mode's edge (median 0.96 against 1.00).

  // Walks a block's user bytes [b->rel, b->rel + n) piece by piece. With
  // `sum`, each piece is summed from `src` (request byte `rel` at src + rel)
  // into its checksum chunk, and a chunk's sum is settled (stored, or checked
  // on verified reads) at its last byte; then fn(rel, nbytes) runs on the
  // piece. A piece is a chunk (chunk_bytes divides the block) or, at the
  // body's end, the chunk's rest; the tail chunk follows.
  template <class Fn>
  int walk(Block* b, int64_t n, const unsigned char* src, bool sum, std::string& msg, Fn fn) {
    Request* r = b->r;
    const int64_t end = b->rel + n;
    const int64_t piece = chunk_bytes;
    uint32_t crc = 0;
    int64_t chunk_start = b->rel;
    for (int64_t p = b->rel; p < end;) {
      int64_t q = std::min(end, (p / piece + 1) * piece);
      if (p < r->aligned) q = std::min(q, r->aligned);
      if (sum) {
        crc = inf_crc32c(crc, src + p, q - p);
        const bool body = p < r->aligned;
        if (body ? (q == r->aligned || q % chunk_bytes == 0) : q == r->nbytes) {
          const int64_t idx = body ? chunk_start / chunk_bytes : (r->aligned + chunk_bytes - 1) / chunk_bytes;
          int rc = settle_crc(r, idx, chunk_start, q, crc, msg);
          if (rc) return rc;
          crc = 0;
          chunk_start = q;
        }
      }
      fn(p, q - p);
      p = q;
    }
    return 0;
  }

  // Stores a chunk's checksum (writes, unverified reads) or checks it against
  // the stored one (verified reads).
  static int settle_crc(Request* r, int64_t idx, int64_t start, int64_t end, uint32_t crc, std::string& msg) {
    if (r->op == INF_IO_READ && r->verify) {
      if (crc != r->crcs[idx]) {
        char buf[1024];
        snprintf(buf, sizeof buf,
                 "checksum mismatch in '%s' at offset %lld (%lld bytes): stored crc32c 0x%08x, "
                 "read 0x%08x (request: offset %lld, %lld bytes)",
                 r->file->path.c_str(), (long long)(r->offset + start), (long long)(end - start), r->crcs[idx],
                 crc, (long long)r->offset, (long long)r->nbytes);
        msg = buf;
        return INF_IO_E_CHECKSUM;
      }
    } else {
      r->crcs[idx] = crc;
    }
    return 0;
  }

  // User bytes a block holds (the rest of a staged block is padding).
  static int64_t user_bytes(const Block* b) {
    return std::max<int64_t>(0, std::min(b->len, b->r->nbytes - b->rel));
  }

  // Before a write: stage the user's bytes into the bounce slot (zero
  // padding), taking the checksums on the way.
  void pre(Block* b) {
    Request* r = b->r;
    if (r->op != INF_IO_WRITE || !r->bounce) return;
    const int64_t n = user_bytes(b);
    std::string unused;
    walk(b, n, r->buf, r->crcs != nullptr && !b->crc_done, unused, [&](int64_t rel, int64_t k) {
      memcpy(b->mem + (rel - b->rel), r->buf + rel, static_cast<size_t>(k));
    });
    if (n < b->len) memset(b->mem + n, 0, static_cast<size_t>(b->len - n));
    b->crc_done = r->crcs != nullptr;
  }

  // Checksums of a direct write block: the bytes do not change while the
  // block is in flight, so the io_uring thread takes them right after
  // submitting it, overlapping the transfer, instead of delaying the next
  // submissions. (Staged blocks took theirs in pre().)
  void write_crcs(Block* b) {
    if (b->r->op == INF_IO_WRITE && b->r->crcs && !b->crc_done) {
      std::string unused;
      walk(b, user_bytes(b), b->mem - b->rel, true, unused, [](int64_t, int64_t) {});
      b->crc_done = true;
    }
  }

  // After a complete transfer: checksums (verified for reads) and the
  // copy-out of staged reads, fused piece by piece.
  int post(Block* b, std::string& msg) {
    Request* r = b->r;
    const bool sum = r->crcs && !b->crc_done;
    const bool copy = r->op == INF_IO_READ && r->bounce;
    if (!sum && !copy) return 0;
    return walk(b, user_bytes(b), b->mem - b->rel, sum, msg, [&](int64_t rel, int64_t k) {
      if (copy) memcpy(r->buf + rel, b->mem + (rel - b->rel), static_cast<size_t>(k));
    });
  }

  // Length of the next syscall of a block (the injected short transfer takes half).
  int64_t next_len(Block* b) {
    int64_t want = b->len - b->done_bytes;
    if (b->fault_short && b->done_bytes == 0 && want >= 2 * kAlign) {
      want = round_down(want / 2);
    }
    return want;
  }

  // ---- thread backend --------------------------------------------------------

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
      if (k == 0) {
        if (r->op == INF_IO_READ) {
          char what[128];
          snprintf(what, sizeof what, "hit end of file after %lld bytes", (long long)b->done_bytes);
          msg = fmt_error(*b, 0, what);
          return INF_IO_E_EOF;
        }
        msg = fmt_error(*b, EIO, "wrote 0 bytes");
        return -EIO;
      }
      b->done_bytes += k;
    }
    return post(b, msg);
  }

  void worker_main() {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      Block* b = nullptr;
      cv_work.wait(lk, [&] { return stopping || (b = claim()) != nullptr; });
      if (!b) return;  // stopping and nothing to do
      lk.unlock();
      std::string msg;
      int err = run_block_sync(b, msg);
      lk.lock();
      finish(b, err, std::move(msg));
      // A freed bounce slot or a finished request can make work claimable.
      cv_work.notify_all();
    }
  }

  // ---- io_uring backend --------------------------------------------------------

  void wake() {
    for (auto& w : urings) {
      uint64_t one = 1;
      ssize_t k = write(w->evfd, &one, sizeof one);
      (void)k;
    }
  }

  static bool arm_poll(UringWorker* w) {
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

  // Submits the SQEs queued in the ring without waiting for completions.
  static void submit_pending(Ring& ring) {
    if (!ring.pending) return;
    int k = sys_uring_enter(ring.fd, ring.pending, 0, 0);
    if (k > 0) ring.pending -= std::min<unsigned>(ring.pending, static_cast<unsigned>(k));
  }

  // Starts a claimed block: an injected fault joins `finished` (reported with
  // the next completions); else the block is staged, queued and, with `now`,
  // submitted at once. True if it went to the disk.
  bool launch(Ring& ring, Block* b, bool now, std::vector<std::pair<Block*, int>>& finished,
              std::vector<std::string>& msgs, int& io_inflight) {
    if (b->fault_err) {
      finished.emplace_back(b, -b->fault_err);
      msgs.push_back(fmt_error(*b, b->fault_err) + " [injected fault]");
      return false;
    }
    pre(b);
    prep_sqe(ring, b);
    io_inflight++;
    if (now) submit_pending(ring);
    return true;
  }

  // Claims blocks up to this ring's share of the queue depth and sends them
  // to the disk; direct writes then take their checksums, overlapping the
  // transfer. True when the engine is stopping and has nothing left.
  bool dispatch(UringWorker* w, std::vector<Block*>& fresh, std::vector<std::pair<Block*, int>>& finished,
                std::vector<std::string>& msgs, int& io_inflight) {
    fresh.clear();
    {
      std::lock_guard<std::mutex> lk(mu);
      while (io_inflight + static_cast<int>(fresh.size()) < w->limit) {
        Block* b = claim();
        if (!b) break;
        fresh.push_back(b);
      }
      if (stopping && active.empty() && inflight == 0) return true;
    }
    // A staged write goes out as soon as it is copied, so the disk works
    // while the next block is staged (else it idles for the whole batch).
    for (Block* b : fresh) launch(w->ring, b, b->slot >= 0 && b->r->op == INF_IO_WRITE, finished, msgs, io_inflight);
    submit_pending(w->ring);
    for (Block* b : fresh) {
      if (!b->fault_err) write_crcs(b);
    }
    return false;
  }

  void uring_main(UringWorker* w) {
    Ring& ring = w->ring;
    const int evfd = w->evfd;
    bool need_poll = true;
    int io_inflight = 0;
    std::vector<std::pair<Block*, int>> finished;  // block, error
    std::vector<std::string> msgs;
    std::vector<Block*> fresh;
    for (;;) {
      // 1. Dispatch new blocks up to the queue depth.
      if (dispatch(w, fresh, finished, msgs, io_inflight)) return;
      if (need_poll && arm_poll(w)) need_poll = false;
      // 2. Submit, and block for at least one completion unless some blocks
      //    are already finished (injected faults) and must be reported.
      unsigned wait_for = finished.empty() ? 1 : 0;
      int rc = sys_uring_enter(ring.fd, ring.pending, wait_for, IORING_ENTER_GETEVENTS);
      if (rc >= 0) {
        ring.pending -= std::min<unsigned>(ring.pending, static_cast<unsigned>(rc));
      } else if (errno != EINTR && errno != EAGAIN && errno != EBUSY) {
        // The ring itself failed: fail every block that is ours to report.
        // (Should not happen; keeps waiters from hanging if it does.)
        fprintf(stderr, "infinity io_uring: io_uring_enter failed: %s\n", strerror(errno));
      }
      // 3. Reap.
      unsigned head = *ring.cq_head;
      unsigned tail = __atomic_load_n(ring.cq_tail, __ATOMIC_ACQUIRE);
      for (; head != tail; head++) {
        io_uring_cqe* cqe = &ring.cqes[head & *ring.cq_mask];
        if (cqe->user_data == 0) {
          uint64_t v;
          ssize_t k = read(evfd, &v, sizeof v);
          (void)k;
          need_poll = true;
          continue;
        }
        auto* b = reinterpret_cast<Block*>(cqe->user_data);
        int res = cqe->res;
        if (res == -EINTR || res == -EAGAIN) {
          prep_sqe(ring, b);  // retry the same range
          continue;
        }
        if (res < 0) {
          io_inflight--;
          finished.emplace_back(b, res);
          msgs.push_back(fmt_error(*b, -res));
          continue;
        }
        if (res == 0) {
          io_inflight--;
          if (b->r->op == INF_IO_READ) {
            char what[128];
            snprintf(what, sizeof what, "hit end of file after %lld bytes", (long long)b->done_bytes);
            finished.emplace_back(b, INF_IO_E_EOF);
            msgs.push_back(fmt_error(*b, 0, what));
          } else {
            finished.emplace_back(b, -EIO);
            msgs.push_back(fmt_error(*b, EIO, "wrote 0 bytes"));
          }
          continue;
        }
        b->done_bytes += res;
        if (b->done_bytes < b->len) {
          prep_sqe(ring, b);  // short transfer: continue where it stopped
          continue;
        }
        io_inflight--;
        finished.emplace_back(b, 0);
        msgs.emplace_back();
      }
      __atomic_store_n(ring.cq_head, head, __ATOMIC_RELEASE);
      submit_pending(ring);  // resubmissions go out now so the disk stays busy during post()
      // Direct blocks need no slot: their successors go out before the
      // completed blocks' checksums are taken (reads were 0.91-0.95 of raw
      // when the ring refilled only after the whole batch's checksums).
      dispatch(w, fresh, finished, msgs, io_inflight);
      // 4. Checksums and copies, then completion. A staged block's slot is
      //    refilled as soon as it is free, so the disk is not left idle while
      //    the copies of a whole batch of completions run.
      for (size_t i = 0; i < finished.size(); i++) {
        Block* b = finished[i].first;
        const bool staged = b->slot >= 0;
        if (finished[i].second == 0) finished[i].second = post(b, msgs[i]);
        Block* next = nullptr;
        {
          std::lock_guard<std::mutex> lk(mu);
          finish(b, finished[i].second, std::move(msgs[i]));
          if (staged && io_inflight < w->limit) next = claim();
        }
        if (next && launch(ring, next, true, finished, msgs, io_inflight)) write_crcs(next);
      }
      finished.clear();
      msgs.clear();
    }
  }

  // ---- lifecycle ------------------------------------------------------------------

  int start(int want_backend) {
    if (want_backend == INF_IO_BACKEND_AUTO || want_backend == INF_IO_BACKEND_URING) {
      const int ncpu = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
      const int nrings = std::min(qd, ncpu);
      int rc = 0;
      for (int i = 0; i < nrings && rc == 0; i++) {
        auto w = std::make_unique<UringWorker>();
        w->limit = qd / nrings + (i < qd % nrings ? 1 : 0);
        rc = w->ring.setup(static_cast<unsigned>(w->limit + 1));
        if (rc == 0) {
          w->evfd = eventfd(0, EFD_CLOEXEC);
          if (w->evfd < 0) {
            rc = -errno;
            w->ring.close_all();
          }
        }
        if (rc == 0) urings.push_back(std::move(w));
      }
      if (rc == 0) {
        backend = INF_IO_BACKEND_URING;
        for (auto& w : urings) {
          UringWorker* wp = w.get();
          w->th = std::thread([this, wp] { uring_main(wp); });
        }
        return 0;
      }
      for (auto& w : urings) {
        w->ring.close_all();
        close(w->evfd);
      }
      urings.clear();
      if (want_backend == INF_IO_BACKEND_URING) return rc;
    }
    backend = INF_IO_BACKEND_THREADS;
    for (int i = 0; i < qd; i++) workers.emplace_back([this] { worker_main(); });
    return 0;
  }

  void stop() {
    {
      std::unique_lock<std::mutex> lk(mu);
      cv_done.wait(lk, [&] { return active.empty() && inflight == 0; });
      stopping = true;
      cv_work.notify_all();
    }
    wake();
    for (auto& t : workers) t.join();
    for (auto& w : urings) {
      if (w->th.joinable()) w->th.join();
      w->ring.close_all();
      if (w->evfd >= 0) close(w->evfd);
    }
    urings.clear();
    for (auto& kv : tickets) delete kv.second;
    tickets.clear();
  }
};

extern "C" {

INF_API int32_t inf_io_engine_create(int32_t backend, int32_t queue_depth, int64_t block_size,
                                     inf_io_engine** out) {
  if (!out || queue_depth < 1 || queue_depth > 1024 || block_size < kAlign || block_size % kAlign)
    return -EINVAL;
  if (backend < INF_IO_BACKEND_AUTO || backend > INF_IO_BACKEND_THREADS) return -EINVAL;
  auto* e = new inf_io_engine();
  e->qd = queue_depth;
  e->block = block_size;
  e->chunk_bytes = chunk_bytes_for(block_size);
  int rc = e->start(backend);
  if (rc) {
    delete e;
    return rc;
  }
  *out = e;
  return 0;
}

INF_API void inf_io_engine_destroy(inf_io_engine* eng) {
  if (!eng) return;
  eng->stop();
  delete eng;
}

INF_API int32_t inf_io_engine_backend(const inf_io_engine* eng) { return eng ? eng->backend : INF_IO_E_UNKNOWN; }

INF_API int32_t inf_io_register(inf_io_engine* eng, int32_t fd, const char* path) {
  if (!eng || fd < 0) return -EINVAL;
  std::lock_guard<std::mutex> lk(eng->mu);
  auto f = std::make_shared<File>(File{fd, path ? path : "?"});
  for (size_t i = 0; i < eng->files.size(); i++) {
    if (!eng->files[i]) {
      eng->files[i] = f;
      return static_cast<int32_t>(i);
    }
  }
  eng->files.push_back(f);
  return static_cast<int32_t>(eng->files.size() - 1);
}

INF_API int32_t inf_io_unregister(inf_io_engine* eng, int32_t file_id) {
  if (!eng) return INF_IO_E_UNKNOWN;
  std::lock_guard<std::mutex> lk(eng->mu);
  if (file_id < 0 || static_cast<size_t>(file_id) >= eng->files.size() || !eng->files[file_id])
    return INF_IO_E_UNKNOWN;
  eng->files[file_id].reset();  // requests in flight keep their own reference
  return 0;
}

INF_API int64_t inf_io_crc_count(int64_t nbytes, int64_t block_size) {
  if (nbytes <= 0 || block_size <= 0 || block_size % kAlign) return 0;
  return infinity_native::sum_chunk_count(nbytes, chunk_bytes_for(block_size));
}

INF_API int64_t inf_io_stage_block(int32_t op, int64_t block_size) {
  if ((op != INF_IO_READ && op != INF_IO_WRITE) || block_size < kAlign || block_size % kAlign) return -EINVAL;
  return stage_block_for(op, block_size);
}

INF_API int32_t inf_io_submit(inf_io_engine* eng, int32_t op, int32_t file_id, int64_t offset, void* buf,
                              int64_t nbytes, void* bounce, int64_t bounce_bytes, uint32_t* crcs,
                              int32_t crcs_in, int64_t* ticket) {
  if (!eng || !ticket) return INF_IO_E_UNKNOWN;
  if ((op != INF_IO_READ && op != INF_IO_WRITE) || nbytes < 0 || offset < 0 || offset % kAlign) return -EINVAL;
  if (nbytes > 0 && !buf) return -EINVAL;
  auto* r = new Request();
  r->op = op;
  r->offset = offset;
  r->buf = static_cast<unsigned char*>(buf);
  r->nbytes = nbytes;
  r->padded = round_up(nbytes);
  r->aligned = round_down(nbytes);
  r->crcs = crcs;
  r->verify = crcs_in && crcs && op == INF_IO_READ;
  r->given = crcs_in && crcs && op == INF_IO_WRITE;
  r->block = bounce ? stage_block_for(op, eng->block) : eng->block;
  r->nblocks = (r->padded + r->block - 1) / r->block;
  if (bounce) {
    r->bounce = static_cast<unsigned char*>(bounce);
    r->slot_bytes = std::min(r->block, std::max<int64_t>(r->padded, kAlign));
    int64_t nslots = bounce_bytes / r->slot_bytes;
    if (nslots < 1 || reinterpret_cast<uintptr_t>(bounce) % kAlign) {
      delete r;
      return -EINVAL;
    }
    nslots = std::min<int64_t>(nslots, std::max<int64_t>(r->nblocks, 1));
    for (int64_t i = nslots - 1; i >= 0; i--) r->free_slots.push_back(static_cast<int>(i));
  } else if (nbytes > 0 && reinterpret_cast<uintptr_t>(buf) % kAlign) {
    delete r;
    return -EINVAL;  // direct mode needs an aligned buffer (use bounce mode)
  }
  {
    std::lock_guard<std::mutex> lk(eng->mu);
    if (file_id < 0 || static_cast<size_t>(file_id) >= eng->files.size() || !eng->files[file_id]) {
      delete r;
      return INF_IO_E_UNKNOWN;
    }
    r->file = eng->files[file_id];
    r->ticket = eng->next_ticket++;
    eng->tickets[r->ticket] = r;
    if (r->nblocks == 0) {
      r->done = true;
    } else {
      eng->active.push_back(r);
    }
    eng->cv_work.notify_all();
  }
  *ticket = r->ticket;
  eng->wake();
  return 0;
}

INF_API int32_t inf_io_wait(inf_io_engine* eng, int64_t ticket, int64_t timeout_ms, char* msg, int64_t msg_len) {
  if (!eng) return INF_IO_E_UNKNOWN;
  std::unique_lock<std::mutex> lk(eng->mu);
  auto it = eng->tickets.find(ticket);
  if (it == eng->tickets.end()) return INF_IO_E_UNKNOWN;
  Request* r = it->second;
  if (timeout_ms < 0) {
    eng->cv_done.wait(lk, [&] { return r->done; });
  } else if (!eng->cv_done.wait_for(lk, std::chrono::milliseconds(timeout_ms), [&] { return r->done; })) {
    return INF_IO_E_TIMEOUT;
  }
  int32_t err = r->err;
  if (msg && msg_len > 0) {
    size_t n = std::min(static_cast<size_t>(msg_len - 1), r->msg.size());
    memcpy(msg, r->msg.data(), n);
    msg[n] = 0;
  }
  eng->tickets.erase(it);
  delete r;
  return err;
}

INF_API int32_t inf_io_done(inf_io_engine* eng, int64_t ticket) {
  if (!eng) return INF_IO_E_UNKNOWN;
  std::lock_guard<std::mutex> lk(eng->mu);
  auto it = eng->tickets.find(ticket);
  if (it == eng->tickets.end()) return INF_IO_E_UNKNOWN;
  return it->second->done ? 1 : 0;
}

INF_API int32_t inf_io_set_fault(inf_io_engine* eng, int32_t op, int64_t nth, int32_t err) {
  if (!eng) return INF_IO_E_UNKNOWN;
  std::lock_guard<std::mutex> lk(eng->mu);
  eng->fault_op = op;
  eng->fault_nth = nth;
  eng->fault_err = err;
  eng->fault_count = 0;
  return 0;
}

}  // extern "C"
