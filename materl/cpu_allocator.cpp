// torch's CPU allocator with tensor data in an address range of its own; see cpu_allocator.py.
//
// One region of address space is reserved up front (MAP_NORESERVE: pages cost memory only once
// written). Every CPU tensor of at least kSmallBytes that a thread allocates inside a scope
// (materl_cpu_allocator_enter/exit, around materl's compute work) is carved from it, best fit
// (the smallest free block that holds the request, the lowest address among equals), and a freed
// block merges with free neighbours at once. Smaller tensors, other code's tensors, and anything
// once the region is full go to c10::alloc_cpu (glibc) as before. The point is what is *not* in
// the region: the small C++ objects that autograd makes between a step's tensors (graph nodes,
// saved-variable records). In glibc's heap they sit between the freed activations and cut their
// space into pieces too small for the next layer's gradients; here freed tensor space stays whole.
//
// Freed memory stays with the process for reuse (as torch's CUDA caching allocator keeps GPU
// memory): returning the free top of the range to the OS past a threshold, as glibc does, cost
// ~155,000 page faults a step when TRL and materl alternate in one process (benchmarks/vs_trl.py).

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <pthread.h>
#include <sys/mman.h>

#include <cstddef>
#include <cstdlib>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>

namespace {

constexpr size_t kAlign = 64;            // c10::alloc_cpu's alignment
constexpr size_t kSmallBytes = 4096;     // below this, glibc (tiny tensors live long: scalars, steps)

class Region {
 public:
  bool reserve(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return false;
    base_ = static_cast<char*>(p);
    capacity_ = bytes;
    return true;
  }

  bool owns(const void* p) const {
    auto c = static_cast<const char*>(p);
    return c >= base_ && c < base_ + capacity_;
  }

  // nullptr when the region cannot hold n more bytes
  void* allocate(size_t n) {
    n = (n + kAlign - 1) / kAlign * kAlign;
    std::lock_guard<std::mutex> guard(mu_);
    size_t offset;
    auto fit = by_size_.lower_bound({n, 0});
    if (fit != by_size_.end()) {
      auto [size, at] = *fit;
      forget(at, size);
      if (size > n) remember(at + n, size - n);
      offset = at;
    } else {
      offset = top_;
      if (!by_offset_.empty()) {  // a free block touching the top is extended, not skipped
        auto last = std::prev(by_offset_.end());
        if (last->first + last->second == top_) {
          offset = last->first;
          forget(last->first, last->second);
        }
      }
      if (offset + n > capacity_) return nullptr;
      top_ = offset + n;
    }
    char* p = base_ + offset;
    sizes_[p] = n;
    in_use_ += n;
    if (in_use_ > peak_in_use_) peak_in_use_ = in_use_;
    return p;
  }

  void release(void* p) {
    std::lock_guard<std::mutex> guard(mu_);
    auto it = sizes_.find(p);
    if (it == sizes_.end()) std::abort();  // not a live block of ours: a double free
    size_t n = it->second;
    sizes_.erase(it);
    in_use_ -= n;
    size_t at = static_cast<char*>(p) - base_;
    auto next = by_offset_.lower_bound(at);
    if (next != by_offset_.end() && at + n == next->first) {
      n += next->second;
      forget(next->first, next->second);
    }
    next = by_offset_.lower_bound(at);
    if (next != by_offset_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == at) {
        at = prev->first;
        n += prev->second;
        forget(prev->first, prev->second);
      }
    }
    remember(at, n);
  }

  // in_use, peak_in_use (since the last call), top, free blocks
  void stats(uint64_t* out) {
    std::lock_guard<std::mutex> guard(mu_);
    out[0] = in_use_;
    out[1] = peak_in_use_;
    out[2] = top_;
    out[3] = by_offset_.size();
    peak_in_use_ = in_use_;
  }

  std::mutex mu_;  // also taken around fork(), so a child never inherits it locked

 private:
  void remember(size_t at, size_t n) {
    by_offset_.emplace(at, n);
    by_size_.insert({n, at});
  }
  void forget(size_t at, size_t n) {
    by_offset_.erase(at);
    by_size_.erase({n, at});
  }

  char* base_ = nullptr;
  size_t capacity_ = 0;
  size_t top_ = 0;  // every block lies below this offset; it never comes down
  size_t in_use_ = 0, peak_in_use_ = 0;
  std::map<size_t, size_t> by_offset_;            // free blocks: offset -> size
  std::set<std::pair<size_t, size_t>> by_size_;   // free blocks: (size, offset)
  std::unordered_map<void*, size_t> sizes_;       // live blocks: address -> size
};

// Never destroyed: tensors are still freed after this library's static destructors would run
// (torch's own statics, at exit), and c10 keeps a pointer to the allocator.
Region& region = *new Region;
thread_local int scope_depth = 0;  // > 0: this thread is doing materl's compute work

void release(void* p) {
  c10::profiledCPUMemoryReporter().Delete(p);
  if (region.owns(p)) {
    region.release(p);
  } else {
    c10::free_cpu(p);
  }
}

struct RegionAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = scope_depth > 0 && n >= kSmallBytes ? region.allocate(n) : nullptr;
    if (p == nullptr) p = c10::alloc_cpu(n);
    c10::profiledCPUMemoryReporter().New(p, n);  // what torch.profiler's profile_memory reads
    return {p, p, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void* dest, const void* src, size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

RegionAllocator& allocator = *new RegionAllocator;

}  // namespace

extern "C" {

// Reserve `bytes` of address space and make this torch's CPU allocator. 0 on success.
int materl_cpu_allocator_install(uint64_t bytes) {
  if (!region.reserve(bytes)) return 1;
  if (pthread_atfork([] { region.mu_.lock(); }, [] { region.mu_.unlock(); }, [] { region.mu_.unlock(); }) != 0) {
    return 2;
  }
  c10::SetCPUAllocator(&allocator, /*priority=*/100);
  return 0;
}

void materl_cpu_allocator_enter() { ++scope_depth; }
void materl_cpu_allocator_exit() { --scope_depth; }

int materl_cpu_allocator_owns(uint64_t address) {
  return region.owns(reinterpret_cast<void*>(address)) ? 1 : 0;
}

void materl_cpu_allocator_stats(uint64_t* out) { region.stats(out); }

}  // extern "C"
