/* C ABI of infinity's asynchronous I/O engine and CRC32C.
 *
 * Same conventions as infinity_native.h: extern "C", raw pointers and byte
 * counts, int return codes (0 = success, negative = failure). Python binds it
 * with ctypes (infinity/io/engine.py); ctypes releases the GIL for each call,
 * so a thread blocked in inf_io_wait() does not stall the interpreter.
 *
 * Model. A request is (registered file, file offset, host pointer, bytes). The
 * engine splits it into blocks of `block_size` bytes and keeps up to
 * `queue_depth` blocks in flight over all requests, by io_uring when the
 * kernel offers it, else by a pool of threads doing pread/pwrite. Every block
 * is checked on completion: a short transfer is continued to its end, an
 * error (ENOSPC, EIO, ...) fails the request, and inf_io_wait() returns the
 * negative errno with a message naming path, offset, bytes and errno text.
 *
 * O_DIRECT. Transfers are padded to 4 KiB: a request of n bytes moves
 * round_up(n, 4096) bytes to or from the file. In direct mode (bounce == NULL)
 * `buf` must be 4 KiB-aligned and hold round_up(n, 4096) bytes. In bounce
 * mode `buf` may have any alignment and holds exactly n bytes: it moves in
 * blocks of inf_io_stage_block() bytes, each staged through a slot of the (4 KiB-
 * aligned) bounce area, so only n bytes of `buf` are read or written; padding
 * written to the file is zeros.
 *
 * Checksums. With `crcs` non-NULL, one CRC32C is kept per checksum chunk of
 * the request: chunk i covers bytes [i*C, min((i+1)*C, A)) with C the largest
 * power of two dividing both the block size and 256 KiB (256 KiB for the usual
 * 1-16 MiB blocks) and A = n rounded DOWN to 4 KiB, then one more chunk
 * covers the unaligned tail [A, n) when n > A. inf_io_crc_count() gives the
 * count. The rule depends only on n and the block size, so a request split
 * into an aligned body and a tail (two requests) yields the same list as one
 * bounce request.
 * Writes store the CRCs into crcs[]; reads with verify=1 compare against
 * crcs[] and fail with INF_IO_E_CHECKSUM naming the chunk's offset.
 */
#ifndef INFINITY_IO_H
#define INFINITY_IO_H

#include <stdint.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#ifndef INF_API
#define INF_API __attribute__((visibility("default")))
#endif

#define INF_IO_ALIGN 4096

/* Backends. */
#define INF_IO_BACKEND_AUTO 0    /* io_uring if the kernel allows, else threads */
#define INF_IO_BACKEND_URING 1
#define INF_IO_BACKEND_THREADS 2

/* Operations. */
#define INF_IO_READ 0
#define INF_IO_WRITE 1

/* Return codes beyond -errno (errno values are < 4096). */
#define INF_IO_E_CHECKSUM (-10001) /* stored and computed CRC32C differ */
#define INF_IO_E_UNKNOWN (-10002)  /* unknown ticket, file or engine */
#define INF_IO_E_EOF (-10003)      /* read hit end of file before the end of the request */
#define INF_IO_E_TIMEOUT (-10004)  /* inf_io_wait timed out; request still pending */

typedef struct inf_io_engine inf_io_engine;

/* Creates an engine. backend: INF_IO_BACKEND_*; queue_depth: blocks in flight
 * (1..1024; also the thread count of the thread backend); block_size: bytes
 * per block, a multiple of 4096. On success stores the engine in *out and
 * returns 0; returns -errno (e.g. -ENOSYS when io_uring is asked for and the
 * kernel refuses it) otherwise. */
INF_API int32_t inf_io_engine_create(int32_t backend, int32_t queue_depth, int64_t block_size,
                                     inf_io_engine** out);
/* Waits for every request, stops the threads, frees the engine. */
INF_API void inf_io_engine_destroy(inf_io_engine* eng);
/* Backend actually running: INF_IO_BACKEND_URING or INF_IO_BACKEND_THREADS. */
INF_API int32_t inf_io_engine_backend(const inf_io_engine* eng);

/* Registers an open file descriptor (the caller keeps ownership and must not
 * close it before inf_io_unregister). `path` is copied and used in error
 * messages. Returns a file id >= 0, or a negative code. */
INF_API int32_t inf_io_register(inf_io_engine* eng, int32_t fd, const char* path);
INF_API int32_t inf_io_unregister(inf_io_engine* eng, int32_t file_id);

/* Submits one request and returns its ticket (> 0) in *ticket. All pointers
 * (buf, bounce, crcs) must stay valid until inf_io_wait returns for it.
 * bounce/bounce_bytes: staging area for bounce mode (NULL/0 for direct mode);
 * bounce_bytes is a multiple of 4096, at least one slot of min(inf_io_stage_block(op, block), padded n).
 * crcs: NULL (no checksums) or inf_io_crc_count(nbytes, block) CRC32Cs, one per
 * checksum chunk. crcs_in == 0: the engine computes them and stores them in
 * crcs (writes; reads left unverified). crcs_in != 0: crcs is input; a read
 * checks the data against it (INF_IO_E_CHECKSUM on a mismatch), a write takes
 * it as the data's sums, computed by whoever produced the bytes, and does not
 * read the buffer for them ([Note: sums from the producer]). */
INF_API int32_t inf_io_submit(inf_io_engine* eng, int32_t op, int32_t file_id, int64_t offset,
                              void* buf, int64_t nbytes, void* bounce, int64_t bounce_bytes,
                              uint32_t* crcs, int32_t crcs_in, int64_t* ticket);

/* Waits for a ticket. timeout_ms < 0 waits forever. Returns 0 on success,
 * INF_IO_E_TIMEOUT if still pending (the ticket stays valid), otherwise the
 * request's error (-errno or INF_IO_E_*) with a message in msg (NUL-terminated,
 * truncated to msg_len). A ticket is released once this returns anything but
 * INF_IO_E_TIMEOUT. */
INF_API int32_t inf_io_wait(inf_io_engine* eng, int64_t ticket, int64_t timeout_ms, char* msg,
                            int64_t msg_len);
/* 1 if the ticket has completed (successfully or not), 0 if pending, <0 unknown. */
INF_API int32_t inf_io_done(inf_io_engine* eng, int64_t ticket);

/* Fault injection for tests: the nth block (1-based, counted from this call)
 * of operation op (INF_IO_READ/WRITE, or -1 for either) fails with -err, or,
 * with err == 0, transfers only half its bytes in its first syscall (to test
 * the short-transfer path). With op == INF_IO_FAULT_RING, from the moment the
 * nth block (of either op) is claimed every io_uring_enter of the engine fails
 * with err (EIO when 0): a dead ring, whose blocks then fail with err
 * (io_uring backend only; the thread backend ignores it). nth <= 0 disables. */
#define INF_IO_FAULT_RING 2
INF_API int32_t inf_io_set_fault(inf_io_engine* eng, int32_t op, int64_t nth, int32_t err);

/* Bytes per block of a bounce-mode request of op (INF_IO_READ/WRITE) on an
 * engine with this block size: min(block_size, 1 MiB) for reads and
 * min(block_size, 256 KiB) for writes; a bounce area needs at least one such
 * slot (or round_up(n, 4096) for a smaller request). -EINVAL on bad input. */
INF_API int64_t inf_io_stage_block(int32_t op, int64_t block_size);

/* Number of checksum chunks of a request of nbytes with this block size. */
INF_API int64_t inf_io_crc_count(int64_t nbytes, int64_t block_size);

/* CRC32C (Castagnoli), standard form: crc = inf_crc32c(0, p, n) gives the
 * usual value (0xE3069283 for "123456789"); pass a previous result to continue.
 * Chosen at run time: AVX-512 VPCLMULQDQ folding, else the SSE4.2 crc32
 * instruction, else a table. */
INF_API uint32_t inf_crc32c(uint32_t crc, const void* data, int64_t nbytes);
/* Path in use: 2 = VPCLMULQDQ folding, 1 = SSE4.2 crc32, 0 = table. */
INF_API int32_t inf_crc32c_hw(void);
/* Tests: force=1 forces the table path, 2 the SSE4.2 path (no folding),
 * 0 restores the automatic choice. */
INF_API void inf_crc32c_force_sw(int32_t force);

#ifdef __cplusplus
}
#endif
#endif /* INFINITY_IO_H */
