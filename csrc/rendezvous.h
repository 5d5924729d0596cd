// A meeting point for the W threads of a group in one process (the simulated CUDA world's
// collectives, csrc/cuda/symm_sim.cpp): every rank calls meet() for the same collective; the last
// to arrive runs the collective's one action before any of them returns, and all return its
// result. A rank that does not arrive within the timeout fails that meeting, naming the missing
// ranks, and every later one (the group is unusable: a rank is gone or stuck).
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace comet {

class Rendezvous {
 public:
  // who: the group's name in error messages.
  Rendezvous(int32_t world, double timeout_s, std::string who)
      : world_(world), timeout_s_(timeout_s), who_(std::move(who)), here_(size_t(world), false) {}

  int32_t world() const { return world_; }

  // `last` (may be empty: a plain barrier) runs on the last rank's thread, under the meeting's
  // lock; its result is every rank's return value.
  void* meet(int32_t rank, const char* what, const std::function<void*()>& last) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!broken_.empty()) throw std::runtime_error(broken_);
    if (rank < 0 || rank >= world_ || here_[size_t(rank)])
      throw std::invalid_argument(who_ + ": rank " + std::to_string(rank) + " cannot meet for " +
                                  what + " (outside the group of " + std::to_string(world_) +
                                  ", or already there)");
    const uint64_t generation = generation_;
    here_[size_t(rank)] = true;
    if (++arrived_ == world_) {
      result_ = last ? last() : nullptr;
      arrived_ = 0;
      std::fill(here_.begin(), here_.end(), false);
      ++generation_;
      cv_.notify_all();
      return result_;
    }
    cv_.wait_for(lock, std::chrono::duration<double>(timeout_s_),
                 [&] { return generation_ != generation || !broken_.empty(); });
    // Read under the lock: the next meeting cannot complete before this rank arrives at it.
    if (generation_ != generation) return result_;
    if (broken_.empty()) {
      std::ostringstream m;
      m << who_ << ": rank(s)";
      for (int32_t r = 0; r < world_; ++r)
        if (!here_[size_t(r)]) m << " " << r;
      m << " did not reach " << what << " within " << timeout_s_
        << " s (every rank's thread must make the same collective calls: creation, reserve, "
           "grows, close)";
      broken_ = m.str();
      cv_.notify_all();
    }
    throw std::runtime_error(broken_);
  }

 private:
  const int32_t world_;
  const double timeout_s_;
  const std::string who_;
  std::mutex mu_;
  std::condition_variable cv_;
  int32_t arrived_ = 0;
  uint64_t generation_ = 0;
  std::vector<bool> here_;
  void* result_ = nullptr;
  std::string broken_;
};

}  // namespace comet
