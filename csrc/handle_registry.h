// The live objects Python holds by integer handle (the CPU backend's heaps, the CUDA buffers, the
// simulated CUDA groups being built): one registry type for each, thread-safe, since the ranks of
// a simulated world create, use and release theirs from threads of one process.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

namespace comet {

template <class T>
class HandleRegistry {
 public:
  explicit HandleRegistry(int64_t first) : next_(first) {}

  int64_t add(std::shared_ptr<T> v) {
    std::lock_guard<std::mutex> lock(mu_);
    items_[next_] = std::move(v);
    return next_++;
  }
  // Null when no live object has this handle.
  std::shared_ptr<T> find(int64_t handle) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = items_.find(handle);
    return it == items_.end() ? nullptr : it->second;
  }
  // Removes it and hands it back (null when none), so the caller may finish it outside the lock.
  std::shared_ptr<T> take(int64_t handle) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = items_.find(handle);
    if (it == items_.end()) return nullptr;
    std::shared_ptr<T> v = std::move(it->second);
    items_.erase(it);
    return v;
  }

 private:
  mutable std::mutex mu_;
  std::map<int64_t, std::shared_ptr<T>> items_;
  int64_t next_;
};

}  // namespace comet
