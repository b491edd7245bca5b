// The helper threads every tiled product runs on (ChunkPool), and what a product tells them about the weights it
// reads (WeightRange), for the read-ahead.  One pool per process: the extension's sources include this header and
// share ChunkPool::instance().
#pragma once
#include <torch/extension.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
static inline void cpu_relax() { _mm_pause(); }
#else
static inline void cpu_relax() { std::this_thread::yield(); }
#endif

// Helper threads for one product at a time.  The work is cut into chunks that every thread, the caller
// included, claims from one counter; the caller never waits for a helper to wake up, only for chunks a helper
// has already claimed, so a helper that sleeps or is descheduled costs the product its help, not a wait.
// A helper that found no new work for kSpinMicroseconds sleeps on a futex until the next product: long enough
// to span the ops between the products of one step, short enough that an idle engine burns no core.
constexpr int64_t kSpinMicroseconds = 200;

// The weights a product reads, named so the pool can learn which product follows which (ChunkPool::run).
struct WeightRange {
  const void* begin = nullptr;
  int64_t bytes = 0;
};

// A helper with nothing to do reads ahead the weights of the products that came next last time, up to this share
// of its L2 cache (in quarters), and takes the chunks it read first: a decode step of one request leaves a helper
// idle through its attention and Python, and from memory one core reads at about half the machine's bandwidth.
constexpr int64_t kWarmQuartersOfL2 = 3;
constexpr int kWarmRanges = 4;
constexpr size_t kMaxSuccessors = 1 << 14;
constexpr int64_t kWarmCheckBytes = 4096;  // how often a warming helper looks for a new product

class ChunkPool {
 public:
  using Work = void (*)(const void* context, int64_t chunk);
  static constexpr int64_t kMaxChunks = (int64_t{1} << 20) - 1;

  static ChunkPool& instance() {
    static ChunkPool* pool = new ChunkPool();  // never destroyed: its helpers are detached and die with the process
    return *pool;
  }

  // Runs work(context, chunk) for every chunk in [0, chunks).  Helpers claim chunks from the front and the caller
  // from the back, so a helper runs first what it read ahead.  `weights`, where given, is what the product
  // reads: the pool remembers the order in which weights follow each other and, while the helpers are idle after
  // this product, reads ahead the ones that followed it before.
  void run(int threads, int64_t chunks, Work work, const void* context, WeightRange weights = {}) {
    if (threads <= 1 || chunks <= 1) {
      if (threads > 1 && weights.begin != nullptr) {
        std::lock_guard<std::mutex> one_product_at_a_time(caller_);
        plan_warming(weights);
      }
      for (int64_t chunk = 0; chunk < chunks; ++chunk) work(context, chunk);
      return;
    }
    TORCH_CHECK(chunks <= kMaxChunks, "ChunkPool: at most ", kMaxChunks, " chunks per product, got ", chunks);
    std::lock_guard<std::mutex> one_product_at_a_time(caller_);
    start_helpers(threads - 1);
    const uint64_t generation = ((state_.load(std::memory_order_relaxed) >> kGenerationShift) + 1) & kGenerationMask;
    plan_warming(weights);
    publish_plan(generation);
    work_ = work;
    context_ = context;
    failure_ = nullptr;
    finished_.store(0, std::memory_order_relaxed);
    state_.store((generation << kGenerationShift) | static_cast<uint64_t>(chunks), std::memory_order_seq_cst);
    wake_sequence_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0)
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&wake_sequence_), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
    drain(generation, true);
    // Every chunk claimed is waited for, even after a failure: they all read the caller's context.
    while (finished_.load(std::memory_order_acquire) < chunks) cpu_relax();
    if (failure_) std::rethrow_exception(failure_);
  }

  template <typename F>
  void run(int threads, int64_t chunks, const F& f, WeightRange weights = {}) {
    run(threads, chunks, [](const void* context, int64_t chunk) { (*static_cast<const F*>(context))(chunk); }, &f,
        weights);
  }

  // The plan the last product published (begin, bytes per range), and the budget plans are cut to: for the tests.
  std::vector<std::pair<int64_t, int64_t>> published_plan() {
    std::lock_guard<std::mutex> one_product_at_a_time(caller_);
    const WarmPlan& plan = plans_[(state_.load(std::memory_order_relaxed) >> kGenerationShift) & 1];
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (int i = 0; i < kWarmRanges && plan.begin[i].load() != nullptr; ++i)
      ranges.emplace_back(reinterpret_cast<int64_t>(plan.begin[i].load()), plan.bytes[i].load());
    return ranges;
  }
  int64_t warm_budget() const { return warm_budget_; }

 private:
  // The state word: the product's generation, then the first and one past the last chunk not yet claimed.
  static constexpr int kGenerationShift = 40, kFrontShift = 20;
  static constexpr uint64_t kGenerationMask = (uint64_t{1} << 24) - 1, kChunkMask = (uint64_t{1} << 20) - 1;

  // What the helpers read ahead after one product: a plan per generation, two slots, so the caller writes the
  // next product's plan while a helper may still be copying this one's.
  struct WarmPlan {
    std::atomic<const char*> begin[kWarmRanges];
    std::atomic<int64_t> bytes[kWarmRanges];
  };

  ChunkPool() {
    pthread_atfork(nullptr, nullptr, [] { instance().helpers_ = 0; });
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    warm_budget_ = (l2 > 0 ? l2 : 1 << 20) / 4 * kWarmQuartersOfL2;
    for (auto& plan : plans_)
      for (int i = 0; i < kWarmRanges; ++i) plan.begin[i].store(nullptr), plan.bytes[i].store(0);
  }

  void start_helpers(int wanted) {
    for (; helpers_ < wanted; ++helpers_) std::thread([this] { helper(); }).detach();
  }

  // Learns that `weights` followed the last product's, and plans what comes after `weights`, up to the budget.
  // A product without weights (an attention's tasks, rows of an elementwise op) keeps the plan of the last one
  // with them.  Called with caller_ held.
  void plan_warming(const WeightRange& weights) {
    if (weights.begin == nullptr) return;
    if (successor_.size() > kMaxSuccessors) successor_.clear();  // weights of engines long gone
    if (last_weights_ != nullptr && last_weights_ != weights.begin) successor_[last_weights_] = weights;
    last_weights_ = weights.begin;
    int count = 0;
    int64_t budget = warm_budget_;
    const void* at = weights.begin;
    for (auto next = successor_.find(at); count < kWarmRanges && budget > 0 && next != successor_.end();
         next = successor_.find(at)) {
      if (next->second.begin == weights.begin) break;  // round the cycle of one step's products
      last_plan_[count] = {next->second.begin, std::min(budget, next->second.bytes)};
      budget -= last_plan_[count].bytes;
      at = next->second.begin;
      ++count;
    }
    last_plan_count_ = count;
  }

  // Writes the plan into generation's slot, before the generation is published.  Called with caller_ held.
  void publish_plan(uint64_t generation) {
    WarmPlan& plan = plans_[generation & 1];
    for (int i = 0; i < kWarmRanges; ++i) {
      const bool used = i < last_plan_count_;
      plan.begin[i].store(used ? static_cast<const char*>(last_plan_[i].begin) : nullptr, std::memory_order_relaxed);
      plan.bytes[i].store(used ? last_plan_[i].bytes : 0, std::memory_order_relaxed);
    }
  }

  // Claim and run chunks of `generation` until none is left: the caller from the back, helpers from the front.
  // The state word holds the generation with the chunks still unclaimed, so a claim is checked against its own
  // product: a thread holding a stale state cannot claim a chunk of the next product before it is published.
  void drain(uint64_t generation, bool from_back) {
    uint64_t state = state_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t front = (state >> kFrontShift) & kChunkMask, back = state & kChunkMask;
      if ((state >> kGenerationShift) != generation || front >= back) return;
      const uint64_t claimed = from_back ? state - 1 : state + (uint64_t{1} << kFrontShift);
      if (!state_.compare_exchange_weak(state, claimed, std::memory_order_acq_rel, std::memory_order_acquire))
        continue;
      // The fields are this generation's: the next product cannot start before this chunk is finished.
      const int64_t chunk = static_cast<int64_t>(from_back ? back - 1 : front);
      try {
        work_(context_, chunk);
      } catch (...) {
        std::lock_guard<std::mutex> first_failure(failure_lock_);
        if (!failure_) failure_ = std::current_exception();
      }
      finished_.fetch_add(1, std::memory_order_release);
      state = state_.load(std::memory_order_acquire);
    }
  }

  // Asks for generation's plan in this core's L2, line by line, until done or a new product starts.  Prefetches,
  // not loads: a plan may name weights freed since (another engine's), and a prefetch of unmapped memory is dropped.
  void warm(uint64_t generation) {
    const WarmPlan& plan = plans_[generation & 1];
    const char* begin[kWarmRanges];
    int64_t bytes[kWarmRanges];
    for (int i = 0; i < kWarmRanges; ++i) {
      begin[i] = plan.begin[i].load(std::memory_order_relaxed);
      bytes[i] = plan.bytes[i].load(std::memory_order_relaxed);
    }
    // A newer generation may have rewritten the slot while it was copied (the one after that writes it).
    if ((state_.load(std::memory_order_acquire) >> kGenerationShift) != generation) return;
    for (int i = 0; i < kWarmRanges && begin[i] != nullptr; ++i) {
      for (int64_t at = 0; at < bytes[i]; at += kWarmCheckBytes) {
        if ((state_.load(std::memory_order_relaxed) >> kGenerationShift) != generation) return;
        const int64_t end = std::min(bytes[i], at + kWarmCheckBytes);
        for (int64_t line = at; line < end; line += 64) __builtin_prefetch(begin[i] + line, 0, 2);  // to L2
      }
    }
  }

  void helper() {
    uint64_t seen = state_.load(std::memory_order_acquire) >> kGenerationShift;
    for (;;) {
      auto idle_since = std::chrono::steady_clock::now();
      uint64_t generation;
      for (int spins = 0; (generation = state_.load(std::memory_order_acquire) >> kGenerationShift) == seen; ++spins) {
        cpu_relax();
        if ((spins & 63) != 63) continue;
        // Hand the core to any other runnable thread (an OpenMP worker of the ops between products).
        std::this_thread::yield();
        const auto idle = std::chrono::steady_clock::now() - idle_since;
        if (std::chrono::duration_cast<std::chrono::microseconds>(idle).count() < kSpinMicroseconds) continue;
        const uint32_t sequence = wake_sequence_.load(std::memory_order_seq_cst);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        if ((state_.load(std::memory_order_seq_cst) >> kGenerationShift) == seen)
          syscall(SYS_futex, reinterpret_cast<uint32_t*>(&wake_sequence_), FUTEX_WAIT_PRIVATE, sequence, nullptr,
                  nullptr, 0);
        sleepers_.fetch_sub(1, std::memory_order_seq_cst);
        idle_since = std::chrono::steady_clock::now();
      }
      seen = generation;
      drain(generation, false);
      warm(generation);
    }
  }

  std::mutex caller_;
  int helpers_ = 0;
  Work work_ = nullptr;
  const void* context_ = nullptr;
  std::atomic<uint64_t> state_{0};  // generation, first and end of the unclaimed chunks (kGenerationShift, ...)
  std::atomic<int64_t> finished_{0};
  std::mutex failure_lock_;
  std::exception_ptr failure_;  // the first chunk's exception, rethrown to the caller once every chunk is done
  std::atomic<uint32_t> wake_sequence_{0};
  std::atomic<int> sleepers_{0};
  // Read ahead (caller_ guards all but plans_): which weights followed which, the last product's, its plan.
  std::unordered_map<const void*, WeightRange> successor_;
  const void* last_weights_ = nullptr;
  WeightRange last_plan_[kWarmRanges];
  int last_plan_count_ = 0;
  int64_t warm_budget_ = 0;
  WarmPlan plans_[2];
};

// What a product reads, for the pool's read-ahead (ChunkPool::run).
static inline WeightRange weights_of(const torch::Tensor& tiles) {
  return {tiles.data_ptr(), static_cast<int64_t>(tiles.nbytes())};
}

// Tiles per chunk: whole blocks, about eight chunks per thread so a late helper leaves little to wait for.
static inline int64_t chunk_tiles(int64_t n_tiles, int64_t block_tiles, int64_t threads) {
  const int64_t wanted = (n_tiles + 8 * threads - 1) / (8 * threads);
  return std::max<int64_t>(block_tiles, (wanted + block_tiles - 1) / block_tiles * block_tiles);
}
