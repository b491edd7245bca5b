// torch's CPU tensors from a cache of freed blocks, kept by size class (docs/design/cpu-fast-paths.md#host-allocator).
//
// A decode step allocates and frees the same few hundred temporaries every step: products' outputs, normed rows,
// activations, quantized rows. torch asks the C library for each with posix_memalign (64-byte alignment), which
// glibc serves by splitting a larger chunk and merging the rest back; on a 64-request W8A8 decode that search took
// ~6 % of the process's samples. Here a freed block goes to a list for its size class and the next request of that
// class takes it back, under one mutex; blocks above a size limit, and blocks that would take the kept bytes over
// their limit, go back to the C library. A request whose class has no block takes one of the next classes, up to
// twice its size, before asking the C library: a step of a new size (a prefill's row count) then reuses memory
// earlier steps left, instead of faulting in fresh pages while that memory lies idle.

#include <torch/extension.h>

#include <c10/core/CPUAllocator.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

constexpr size_t kAlignment = 64;  // torch's own CPU alignment
constexpr size_t kHeader = kAlignment;  // the block's size class, stored before its data (keeps the data aligned)
constexpr size_t kNotKept = 0;  // the class stored in a block too large to keep
constexpr size_t kSmallBlock = 512;  // up to this size, classes are every 64 bytes
constexpr size_t kClassesPerDoubling = 8;  // above it, at most 12.5 % of a block is rounding
constexpr size_t kLargestSpare = 2;  // a request may take a kept block up to this many times its class

size_t size_class(size_t bytes) {
  if (bytes <= kSmallBlock) return bytes <= kAlignment ? kAlignment : (bytes + kAlignment - 1) / kAlignment * kAlignment;
  size_t power = kSmallBlock;
  while (power < bytes) power <<= 1;
  const size_t step = power / kClassesPerDoubling;
  return (bytes + step - 1) / step * step;
}

class BlockCache {
 public:
  void configure(size_t kept_limit, size_t largest_kept) {
    std::lock_guard<std::mutex> lock(mutex_);
    kept_limit_ = kept_limit;
    largest_kept_ = largest_kept;
  }

  // A block of at least `bytes` (its class stored in its header); `data` is what the tensor sees.
  void* take(size_t bytes) {
    size_t block_class = kNotKept;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (bytes > largest_kept_) {
        ++bypassed_;
      } else {
        block_class = size_class(bytes);
        for (size_t kept = block_class; kept <= kLargestSpare * block_class; kept = size_class(kept + 1)) {
          auto found = free_.find(kept);
          if (found == free_.end() || found->second.empty()) continue;
          void* block = found->second.back();  // its header keeps its own class, where it goes back
          found->second.pop_back();
          kept_bytes_ -= kept;
          ++reused_;
          return static_cast<char*>(block) + kHeader;
        }
        ++fresh_;
      }
    }
    const size_t size = block_class == kNotKept ? bytes : block_class;
    void* block = nullptr;
    TORCH_CHECK(size <= SIZE_MAX - kHeader && posix_memalign(&block, kAlignment, size + kHeader) == 0,
                "patchbay's block cache: not enough memory for a tensor of ", bytes, " bytes");
    *static_cast<size_t*>(block) = block_class;
    return static_cast<char*>(block) + kHeader;
  }

  void give_back(void* data) {
    if (data == nullptr) return;
    void* block = static_cast<char*>(data) - kHeader;
    const size_t block_class = *static_cast<size_t*>(block);
    if (block_class != kNotKept) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (kept_bytes_ + block_class <= kept_limit_) {
        free_[block_class].push_back(block);
        kept_bytes_ += block_class;
        return;
      }
    }
    std::free(block);
  }

  // Hand every kept block back to the C library; the bytes they held.
  size_t release() {
    std::unordered_map<size_t, std::vector<void*>> kept;
    size_t bytes = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      kept.swap(free_);
      bytes = kept_bytes_;
      kept_bytes_ = 0;
    }
    for (auto& [block_class, blocks] : kept)
      for (void* block : blocks) std::free(block);
    return bytes;
  }

  std::vector<int64_t> counters() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {static_cast<int64_t>(kept_bytes_), reused_, fresh_, bypassed_};
  }

 private:
  std::mutex mutex_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  size_t kept_bytes_ = 0;
  size_t kept_limit_ = 0;
  size_t largest_kept_ = 0;
  int64_t reused_ = 0, fresh_ = 0, bypassed_ = 0;
};

BlockCache& block_cache() {
  static BlockCache* cache = new BlockCache();  // never destroyed: tensors may be freed during exit
  return *cache;
}

void give_back(void* data) { block_cache().give_back(data); }

class CachingAllocator final : public at::Allocator {
 public:
  at::DataPtr allocate(size_t bytes) override {
    if (bytes == 0) return {nullptr, nullptr, &give_back, at::Device(at::DeviceType::CPU)};
    void* data = block_cache().take(bytes);
    // The context is the data pointer itself, so raw_allocate() and raw_deleter() work too.
    return {data, data, &give_back, at::Device(at::DeviceType::CPU)};
  }

  at::DeleterFnPtr raw_deleter() const override { return &give_back; }

  void copy_data(void* destination, const void* source, size_t bytes) const override {
    default_copy_data(destination, source, bytes);
  }
};

CachingAllocator* caching_allocator() {
  static CachingAllocator* allocator = new CachingAllocator();  // never destroyed, as the cache
  return allocator;
}

constexpr uint8_t kPriority = 1;  // above torch's default CPU allocator (0), below one a library set on purpose

}  // namespace

// Make the cache torch's CPU allocator, keeping at most `kept_limit` bytes of freed blocks of at most
// `largest_kept` bytes each; whether torch now allocates from it.
bool install(int64_t kept_limit, int64_t largest_kept) {
  block_cache().configure(static_cast<size_t>(kept_limit), static_cast<size_t>(largest_kept));
  c10::SetCPUAllocator(caching_allocator(), kPriority);
  return c10::GetCPUAllocator() == caching_allocator();
}

bool installed() { return c10::GetCPUAllocator() == caching_allocator(); }

int64_t release_kept_blocks() { return static_cast<int64_t>(block_cache().release()); }

// [bytes kept, allocations served from kept blocks, from the C library, and too large to keep]
std::vector<int64_t> counters() { return block_cache().counters(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install, "install");
  m.def("installed", &installed, "installed");
  m.def("release_kept_blocks", &release_kept_blocks, "release_kept_blocks");
  m.def("counters", &counters, "counters");
}
