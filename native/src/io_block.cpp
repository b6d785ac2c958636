// Work on one block outside the engine's lock: staging copies and CRC32C per
// checksum chunk (the chunk rule of chunk_rule.h, docs/io.md "Checksums"),
// and the messages of failed transfers. See io_block.h.
#include "io_block.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>

namespace infinity_native {
namespace io {

namespace {

const char* op_name(int op) { return op == INF_IO_WRITE ? "write" : "read"; }

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

// Stores a chunk's checksum (writes, unverified reads) or checks it against
// the stored one (verified reads).
int settle_crc(Request* r, int64_t idx, int64_t start, int64_t end, uint32_t crc, std::string& msg) {
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

// Walks a block's user bytes [b->rel, b->rel + n) piece by piece. With
// `sum`, each piece is summed from `src` (request byte `rel` at src + rel)
// into its checksum chunk, and a chunk's sum is settled (stored, or checked
// on verified reads) at its last byte; then fn(rel, nbytes) runs on the
// piece. A piece is a chunk (the chunk divides the block) or, at the
// body's end, the chunk's rest; the tail chunk follows.
template <class Fn>
int walk(Block* b, int64_t n, const unsigned char* src, bool sum, std::string& msg, Fn fn) {
  Request* r = b->r;
  const int64_t end = b->rel + n;
  const int64_t chunk_bytes = r->chunk;
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

// User bytes a block holds (the rest of a staged block is padding).
int64_t user_bytes(const Block* b) { return std::max<int64_t>(0, std::min(b->len, b->r->nbytes - b->rel)); }

}  // namespace

std::string fmt_error(const Block& b, int err, const char* what) {
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

int zero_transfer_error(const Block& b, std::string& msg) {
  if (b.r->op == INF_IO_READ) {
    char what[128];
    snprintf(what, sizeof what, "hit end of file after %lld bytes", (long long)b.done_bytes);
    msg = fmt_error(b, 0, what);
    return INF_IO_E_EOF;
  }
  msg = fmt_error(b, EIO, "wrote 0 bytes");
  return -EIO;
}

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

void write_crcs(Block* b) {
  if (b->r->op == INF_IO_WRITE && b->r->crcs && !b->crc_done) {
    std::string unused;
    walk(b, user_bytes(b), b->mem - b->rel, true, unused, [](int64_t, int64_t) {});
    b->crc_done = true;
  }
}

int post(Block* b, std::string& msg) {
  Request* r = b->r;
  const bool sum = r->crcs && !b->crc_done;
  const bool copy = r->op == INF_IO_READ && r->bounce;
  if (!sum && !copy) return 0;
  return walk(b, user_bytes(b), b->mem - b->rel, sum, msg, [&](int64_t rel, int64_t k) {
    if (copy) memcpy(r->buf + rel, b->mem + (rel - b->rel), static_cast<size_t>(k));
  });
}

}  // namespace io
}  // namespace infinity_native
