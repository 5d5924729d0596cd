#include "symm_heap.h"

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "call_verdict.h"
#include "comet/flags.h"

namespace comet::cpu {

SymmHeap::SymmHeap(int32_t rank, int32_t world, std::string job, int64_t group_hash,
                   double timeout_s)
    : rank_(rank), world_(world), job_(std::move(job)), group_hash_(group_hash),
      timeout_s_(timeout_s), peer_headers_(world), headers_(world, nullptr), peer_data_(world),
      data_(world, nullptr) {
  if (world < 1 || rank < 0 || rank >= world)
    throw std::invalid_argument("comet.symm: rank " + std::to_string(rank) +
                                " outside a group of " + std::to_string(world));
  own_header_ = ShmSegment::create(segment_name(rank, "h", 0), header_bytes(world));
  headers_[rank] = own_header_.data();
  flag_release(header(rank)->pid, uint64_t(getpid()));
}

SymmHeap::~SymmHeap() = default;

std::string SymmHeap::segment_name(int32_t r, const char* kind, uint64_t gen) const {
  return "/comet-" + job_ + "-" + std::to_string(r) + "-" + kind + std::to_string(gen);
}

void SymmHeap::connect() {
  for (int32_t r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    peer_headers_[r] = ShmSegment::open(segment_name(r, "h", 0), header_bytes(world_));
    headers_[r] = peer_headers_[r].data();
  }
}

void SymmHeap::unlink_own() { own_header_.unlink(); }

// A peer process that is gone, or a zombie not yet reaped by its parent (e.g. a launcher that
// is itself blocked), counts as dead.
bool SymmHeap::peer_alive(int32_t r) const {
  const pid_t pid = pid_t(flag_relaxed(header(r)->pid));
  if (pid <= 0) return true;
  if (kill(pid, 0) != 0) return errno != ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return true;
  const size_t paren = line.rfind(')');
  return paren == std::string::npos || paren + 2 >= line.size() || line[paren + 2] != 'Z';
}

void SymmHeap::wait(uint64_t* flag, uint64_t epoch, WaitSite site, int64_t index,
                    const std::atomic<bool>* abort) const {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  const bool peer_site = site != WaitSite::RowTile && site != WaitSite::ColumnTile &&
                         site != WaitSite::GridBarrier;
  for (uint64_t spin = 0;; ++spin) {
    if (flag_acquire(flag) >= epoch) return;
    if (abort && abort->load(std::memory_order_relaxed)) throw Aborted{};
    if (spin < 64) continue;
    if (spin < 256)
      std::this_thread::yield();
    else
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    if (spin % 256 != 0) continue;
    const double waited = std::chrono::duration<double>(clock::now() - start).count();
    std::ostringstream msg;
    if (peer_site && index >= 0 && index < world_ && !peer_alive(int32_t(index))) {
      msg << "comet: rank " << rank_ << " waiting for " << wait_site_name(site) << " (call "
          << epoch << "): rank " << index << " (pid " << flag_relaxed(header(int32_t(index))->pid)
          << ") has exited";
      throw std::runtime_error(msg.str());
    }
    if (waited > timeout_s_) {
      msg << "comet: rank " << rank_ << " gave up after " << waited << " s waiting for "
          << wait_site_name(site) << " (index " << index << ", call " << epoch
          << "); a peer may have died, stalled, or called a different op "
             "(timeout set by COMET_TIMEOUT or Buffer(timeout=...))";
      throw std::runtime_error(msg.str());
    }
  }
}

uint64_t SymmHeap::begin_call(CallMeta me) {
  check_usable();
  const uint64_t e = ++epoch_;
  try {
    for (int32_t s = 0; s < world_; ++s) wait(header(s)->done_epoch, e - 1, WaitSite::PeerDone, s);
    me.epoch = e;
    header(rank_)->meta = me;
    flag_release(header(rank_)->meta_epoch, e);
    metas_.resize(world_);
    for (int32_t s = 0; s < world_; ++s) {
      wait(header(s)->meta_epoch, e, WaitSite::PeerMeta, s);
      metas_[s] = header(s)->meta;
    }
  } catch (const std::exception& ex) {
    mark_broken(ex.what());
    throw;
  }
  return e;
}

std::string SymmHeap::verdict(const char* op_name) const {
  return call_verdict(metas_.data(), world_, rank_, rejected_rank(metas_.data(), world_, rank_),
                      op_name);
}

void SymmHeap::reserve(size_t bytes) {
  if (bytes <= capacity_) return;
  size_t cap = bytes > 2 * capacity_ ? bytes : 2 * capacity_;
  cap = align_up(cap, size_t(1) << 16);
  try {
    ++gen_;
    own_data_ = ShmSegment::create(segment_name(rank_, "d", gen_), cap);
    data_[rank_] = own_data_.data();
    flag_release(header(rank_)->gen_ready, gen_);
    for (int32_t s = 0; s < world_; ++s) {
      if (s == rank_) continue;
      wait(header(s)->gen_ready, gen_, WaitSite::PeerGeneration, s);
      peer_data_[s] = ShmSegment::open(segment_name(s, "d", gen_), cap);
      data_[s] = peer_data_[s].data();
      flag_release(header_mapped(header(s), world_, rank_), gen_);
    }
    for (int32_t s = 0; s < world_; ++s)
      if (s != rank_) wait(header_mapped(header(rank_), world_, s), gen_, WaitSite::PeerMapped, s);
    own_data_.unlink();
    capacity_ = cap;
  } catch (const std::exception& ex) {
    mark_broken(ex.what());
    throw;
  }
}

void SymmHeap::end_call(uint64_t epoch) { flag_release(header(rank_)->done_epoch, epoch); }

void SymmHeap::mark_broken(const std::string& why) {
  if (broken_.empty()) broken_ = why;
  own_header_.unlink();
  own_data_.unlink();
}

void SymmHeap::check_usable() const {
  if (!broken_.empty())
    throw std::runtime_error(
        "comet: this buffer is unusable after an earlier communication failure (" + broken_ +
        "); create a new comet.Buffer");
}

namespace {
std::mutex g_mutex;
std::map<int64_t, std::shared_ptr<SymmHeap>> g_heaps;
int64_t g_next = 1;
}  // namespace

int64_t register_heap(std::shared_ptr<SymmHeap> heap) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_heaps[g_next] = std::move(heap);
  return g_next++;
}

std::shared_ptr<SymmHeap> find_heap(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_heaps.find(handle);
  if (it == g_heaps.end())
    throw std::invalid_argument("comet: no live buffer with handle " + std::to_string(handle) +
                                " (closed, or not created by comet.symm)");
  return it->second;
}

void release_heap(int64_t handle) {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_heaps.erase(handle);
}

}  // namespace comet::cpu
