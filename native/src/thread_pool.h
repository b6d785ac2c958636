// A small persistent thread pool for the CPU kernels.
//
// Why our own pool and not OpenMP: torch ships its own libgomp; a second
// OpenMP runtime in the same process would keep its own spinning threads and
// oversubscribe the cores. Our workers sleep on a condition variable between
// calls (after a short spin that hides wake-up latency for back-to-back calls).
#pragma once
#include <stdint.h>

namespace infinity_native {

// Runs fn(ctx, tid) for tid in [0, nthreads); the calling thread runs tid 0.
// Returns when all have finished. Calls from several threads are serialised.
void parallel_run(int nthreads, void (*fn)(void* ctx, int tid), void* ctx);

// Online CPUs in this process's affinity mask (at least 1).
int default_threads();

}  // namespace infinity_native
