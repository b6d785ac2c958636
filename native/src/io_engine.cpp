// Asynchronous block I/O engine: the schedule of blocks shared by the
// backends, the engine's lifecycle and the C API of
// native/include/infinity_io.h. The backends are io_uring by raw syscalls
// (io_uring.cpp, uring_ring.cpp) and a pread/pwrite thread pool
// (io_threads.cpp); the work on each block (staging copies, checksums) is
// io_block.cpp. See docs/io.md for the design.
#include "io_engine.h"

#include <errno.h>
#include <string.h>

#include <algorithm>
#include <chrono>

#include "chunk_rule.h"

using infinity_native::io::Block;
using infinity_native::io::File;
using infinity_native::io::kAlign;
using infinity_native::io::Request;

// ---- shared scheduling (call with mu held) ----------------------------------

Block* inf_io_engine::claim() {
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
    if (fault_nth > 0 && fault_op == INF_IO_FAULT_RING && ++fault_count == fault_nth) {
      ring_fault.store(fault_err ? fault_err : EIO);
      fault_nth = 0;
    } else if (fault_nth > 0 && (fault_op < 0 || fault_op == r->op) && ++fault_count == fault_nth) {
      if (fault_err) b->fault_err = fault_err;
      else b->fault_short = true;
      fault_nth = 0;
    }
    if (r->next_block >= r->nblocks) active.erase(it);
    return b;
  }
  return nullptr;
}

void inf_io_engine::finish(Block* b, int err, std::string&& msg) {
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

// ---- lifecycle ----------------------------------------------------------------

int inf_io_engine::start(int want_backend) {
  if (want_backend == INF_IO_BACKEND_AUTO || want_backend == INF_IO_BACKEND_URING) {
    int rc = infinity_native::io::start_uring(this, &impl);
    if (rc == 0) {
      backend = INF_IO_BACKEND_URING;
      return 0;
    }
    if (want_backend == INF_IO_BACKEND_URING) return rc;
  }
  backend = INF_IO_BACKEND_THREADS;
  impl = infinity_native::io::start_threads(this);
  return 0;
}

void inf_io_engine::stop() {
  {
    std::unique_lock<std::mutex> lk(mu);
    cv_done.wait(lk, [&] { return active.empty() && inflight == 0; });
    stopping = true;
    cv_work.notify_all();
  }
  if (impl) {
    impl->wake();
    impl->join();
  }
  for (auto& kv : tickets) delete kv.second;
  tickets.clear();
}

namespace {

// A request of inf_io_submit's arguments, checked (all but the file id), or
// -EINVAL. Direct mode needs an aligned buffer; bounce mode an aligned area
// of at least one slot.
int32_t make_request(const inf_io_engine* eng, int32_t op, int64_t offset, void* buf, int64_t nbytes,
                     void* bounce, int64_t bounce_bytes, uint32_t* crcs, int32_t crcs_in, Request** out) {
  using namespace infinity_native::io;
  if ((op != INF_IO_READ && op != INF_IO_WRITE) || nbytes < 0 || offset < 0 || offset % kAlign) return -EINVAL;
  if (nbytes > 0 && !buf) return -EINVAL;
  auto r = std::make_unique<Request>();
  r->op = op;
  r->offset = offset;
  r->buf = static_cast<unsigned char*>(buf);
  r->nbytes = nbytes;
  r->padded = round_up(nbytes);
  r->aligned = round_down(nbytes);
  r->crcs = crcs;
  r->chunk = eng->chunk_bytes;
  r->verify = crcs_in && crcs && op == INF_IO_READ;
  r->given = crcs_in && crcs && op == INF_IO_WRITE;
  r->block = bounce ? stage_block_for(op, eng->block) : eng->block;
  r->nblocks = (r->padded + r->block - 1) / r->block;
  if (bounce) {
    r->bounce = static_cast<unsigned char*>(bounce);
    r->slot_bytes = std::min(r->block, std::max<int64_t>(r->padded, kAlign));
    int64_t nslots = bounce_bytes / r->slot_bytes;
    if (nslots < 1 || reinterpret_cast<uintptr_t>(bounce) % kAlign) return -EINVAL;
    nslots = std::min<int64_t>(nslots, std::max<int64_t>(r->nblocks, 1));
    for (int64_t i = nslots - 1; i >= 0; i--) r->free_slots.push_back(static_cast<int>(i));
  } else if (nbytes > 0 && reinterpret_cast<uintptr_t>(buf) % kAlign) {
    return -EINVAL;  // direct mode needs an aligned buffer (use bounce mode)
  }
  *out = r.release();
  return 0;
}

}  // namespace

extern "C" {

INF_API int32_t inf_io_engine_create(int32_t backend, int32_t queue_depth, int64_t block_size,
                                     inf_io_engine** out) {
  if (!out || queue_depth < 1 || queue_depth > 1024 || block_size < kAlign || block_size % kAlign)
    return -EINVAL;
  if (backend < INF_IO_BACKEND_AUTO || backend > INF_IO_BACKEND_THREADS) return -EINVAL;
  auto* e = new inf_io_engine();
  e->qd = queue_depth;
  e->block = block_size;
  e->chunk_bytes = infinity_native::io::chunk_bytes_for(block_size);
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
  return infinity_native::sum_chunk_count(nbytes, infinity_native::io::chunk_bytes_for(block_size));
}

INF_API int64_t inf_io_stage_block(int32_t op, int64_t block_size) {
  if ((op != INF_IO_READ && op != INF_IO_WRITE) || block_size < kAlign || block_size % kAlign) return -EINVAL;
  return infinity_native::io::stage_block_for(op, block_size);
}

INF_API int32_t inf_io_submit(inf_io_engine* eng, int32_t op, int32_t file_id, int64_t offset, void* buf,
                              int64_t nbytes, void* bounce, int64_t bounce_bytes, uint32_t* crcs,
                              int32_t crcs_in, int64_t* ticket) {
  if (!eng || !ticket) return INF_IO_E_UNKNOWN;
  Request* r = nullptr;
  int32_t rc = make_request(eng, op, offset, buf, nbytes, bounce, bounce_bytes, crcs, crcs_in, &r);
  if (rc) return rc;
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
  eng->impl->wake();
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
