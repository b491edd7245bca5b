// Tasks of the attention kernels, on the tiled products' helper threads or over OpenMP
// (patchbay.plugins.attention._cpu_kernel).
#pragma once
#include <cstdint>

// A pool's entry point (patchbay.worker.cpu.streaming_linear.chunk_runner): runs work(context, i) for every i in
// [0, chunks) over the calling thread and threads - 1 helpers.
using RunChunks = void (*)(int threads, int64_t chunks, void (*work)(const void*, int64_t), const void* context);

// task(i) for every i in [0, tasks): on the caller's pool where it passed one (its helpers are awake between the
// step's products, where OpenMP's sleeping threads would have to be woken and then contend with them for the
// cores), else over OpenMP.
template <typename Task>
void run_tasks(RunChunks pool, int threads, int64_t tasks, const Task& task) {
  if (pool != nullptr && threads > 1) {
    pool(threads, tasks, [](const void* context, int64_t i) { (*static_cast<const Task*>(context))(i); }, &task);
    return;
  }
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < tasks; ++i) task(i);
}
