#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <mutex>
#include <vector>

namespace infinity_native {
namespace {

constexpr int kSpinIters = 2000;  // a few tens of microseconds before sleeping

struct Pool {
  std::mutex call_mu;  // one parallel_run at a time
  std::mutex mu;
  std::condition_variable cv_work;
  std::condition_variable cv_done;
  std::atomic<uint64_t> generation{0};
  std::atomic<int> remaining{0};
  void (*fn)(void*, int) = nullptr;
  void* ctx = nullptr;
  int nthreads = 0;     // tids [0, nthreads) run fn this round
  int n_workers = 0;    // workers started so far
};

Pool* g_pool = nullptr;
std::once_flag g_once;

void* worker_main(void* arg);

struct WorkerArg {
  Pool* pool;
  int index;  // 1-based tid
};

void* worker_main(void* raw) {
  WorkerArg* wa = static_cast<WorkerArg*>(raw);
  Pool* pool = wa->pool;
  const int tid = wa->index;
  delete wa;
  uint64_t seen = 0;
  for (;;) {
    // Spin briefly: consecutive kernel calls (one per param group or unit)
    // arrive microseconds apart.
    uint64_t gen = pool->generation.load(std::memory_order_acquire);
    for (int i = 0; gen == seen && i < kSpinIters; ++i) {
#if defined(__x86_64__) || defined(__i386__)
      __builtin_ia32_pause();
#endif
      gen = pool->generation.load(std::memory_order_acquire);
    }
    if (gen == seen) {
      std::unique_lock<std::mutex> lk(pool->mu);
      pool->cv_work.wait(lk, [&] { return pool->generation.load(std::memory_order_acquire) != seen; });
      gen = pool->generation.load(std::memory_order_acquire);
    }
    seen = gen;
    // Every started worker acknowledges every round, even with no work, so
    // no worker can lag a round behind and read the next round's fields.
    if (tid < pool->nthreads) pool->fn(pool->ctx, tid);
    if (pool->remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lk(pool->mu);
      pool->cv_done.notify_one();
    }
  }
  return nullptr;
}

void after_fork_child() {
  // Worker threads do not survive fork(); start a fresh pool lazily. The old
  // one is leaked on purpose: its mutexes may be held by threads that no
  // longer exist.
  g_pool = new Pool();
}

void init_pool() {
  g_pool = new Pool();
  pthread_atfork(nullptr, nullptr, after_fork_child);
}

void ensure_workers(Pool* pool, int n) {
  while (pool->n_workers < n) {
    pthread_t th;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    auto* wa = new WorkerArg{pool, pool->n_workers + 1};
    if (pthread_create(&th, &attr, worker_main, wa) != 0) {
      delete wa;
      pthread_attr_destroy(&attr);
      return;  // run with the workers we have
    }
    pthread_attr_destroy(&attr);
    pool->n_workers++;
  }
}

}  // namespace

int default_threads() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? static_cast<int>(n) : 1;
}

void parallel_run(int nthreads, void (*fn)(void*, int), void* ctx) {
  std::call_once(g_once, init_pool);
  if (nthreads <= 1) {
    fn(ctx, 0);
    return;
  }
  Pool* pool = g_pool;
  std::lock_guard<std::mutex> call_lk(pool->call_mu);
  ensure_workers(pool, nthreads - 1);
  const int workers = pool->n_workers;
  if (workers == 0) {
    for (int t = 0; t < nthreads; ++t) fn(ctx, t);
    return;
  }
  {
    std::lock_guard<std::mutex> lk(pool->mu);
    pool->fn = fn;
    pool->ctx = ctx;
    pool->nthreads = nthreads;
    pool->remaining.store(workers, std::memory_order_relaxed);
    pool->generation.fetch_add(1, std::memory_order_release);
  }
  pool->cv_work.notify_all();
  fn(ctx, 0);
  // tids the pool could not start (thread creation failed) run here.
  for (int t = workers + 1; t < nthreads; ++t) fn(ctx, t);
  for (int i = 0; pool->remaining.load(std::memory_order_acquire) != 0 && i < kSpinIters; ++i) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  if (pool->remaining.load(std::memory_order_acquire) != 0) {
    std::unique_lock<std::mutex> lk(pool->mu);
    pool->cv_done.wait(lk, [&] { return pool->remaining.load(std::memory_order_acquire) == 0; });
  }
}

}  // namespace infinity_native
