#include "symm_heap.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <chrono>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <stdexcept>
#include <thread>

#include "call_verdict.h"
#include "handle_registry.h"
#include "comet/flags.h"
#include "comet/grow_rule.h"

namespace comet::cpu {

std::shared_ptr<SlotPool> device_slot_pool(int64_t key) {
  static std::mutex mutex;
  static std::map<int64_t, std::shared_ptr<SlotPool>> pools;
  std::lock_guard<std::mutex> lock(mutex);
  std::shared_ptr<SlotPool>& p = pools[key];
  if (!p) p = std::make_shared<SlotPool>();
  return p;
}

SymmHeap::SymmHeap(int32_t rank, int32_t world, std::string job, int64_t group_hash,
                   double timeout_s, int32_t ranks_per_node, LinkSettings link)
    : rank_(rank), world_(world), remote_pid_(size_t(world > 0 ? world : 0), 0),
      job_(std::move(job)), group_hash_(group_hash), timeout_s_(timeout_s),
      peer_headers_(world > 0 ? world : 0), headers_(world > 0 ? world : 0, nullptr),
      peer_data_(world > 0 ? world : 0), data_(world > 0 ? world : 0, nullptr) {
  if (world < 1 || rank < 0 || rank >= world)
    throw std::invalid_argument("comet.buffers.symm: rank " + std::to_string(rank) +
                                " outside a group of " + std::to_string(world));
  if (ranks_per_node == 0) ranks_per_node = world;
  if (ranks_per_node < 1 || world % ranks_per_node != 0)
    throw std::invalid_argument("comet.buffers.symm: ranks_per_node=" + std::to_string(ranks_per_node) +
                                " does not divide the group size " + std::to_string(world));
  if (link.latency_us < 0 || link.gbps < 0)
    throw std::invalid_argument("comet.buffers.symm: link latency and bandwidth must be >= 0 (got " +
                                std::to_string(link.latency_us) + " us, " +
                                std::to_string(link.gbps) + " GB/s)");
  topo_ = NodeTopology{world, ranks_per_node};
  own_header_ = ShmSegment::create(segment_name(rank, "h", 0), header_bytes(world));
  headers_[rank] = own_header_.data();
  flag_release(header(rank)->pid, uint64_t(getpid()));
  if (topo_.nodes() > 1) {
    proxy_ = std::make_unique<LinkProxy>(world, link);
    proxy_->set_own(own_header_.data(), own_header_.size(), nullptr, 0);
  }
}

// The proxy first: it may still read this rank's segments while it drains.
SymmHeap::~SymmHeap() { proxy_.reset(); }

std::string SymmHeap::segment_name(int32_t r, const char* kind, uint64_t gen) const {
  return "/comet-" + job_ + "-" + std::to_string(r) + "-" + kind + std::to_string(gen);
}

void SymmHeap::connect() {
  for (int32_t r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    ShmSegment h = ShmSegment::open(segment_name(r, "h", 0), header_bytes(world_));
    if (reachable(r)) {
      peer_headers_[r] = std::move(h);
      headers_[r] = peer_headers_[r].data();
    } else {
      proxy_->map_header(r, std::move(h));  // the link's window: never seen by the ranks' code
      remote_pid_[size_t(r)] = proxy_->read_header_word(r, offsetof(RankHeader, pid));
    }
  }
}

void SymmHeap::send_flag(int32_t r, PeerFlag kind, uint64_t value) {
  if (reachable(r))
    flag_release(header_flag(header(r), world_, kind, rank_), value);
  else
    proxy_->put_signal(r, nullptr, nullptr, 0, header_flag(header(rank_), world_, kind, rank_),
                       value);
}

uint64_t* SymmHeap::source_ready(int32_t s) const {
  if (reachable(s)) return header(s)->data_epoch;
  return header_flag(header(topo_.relay(s, topo_.node(rank_))), world_, PeerFlag::MirrorMeta, s);
}

uint64_t* SymmHeap::rows_ready(int32_t s) const {
  if (reachable(s)) return nullptr;
  return header_flag(header(topo_.relay(s, topo_.node(rank_))), world_, PeerFlag::MirrorRows, s);
}

uint64_t SymmHeap::peer_pid(int32_t r) const {
  return reachable(r) ? flag_relaxed(header(r)->pid) : remote_pid_[size_t(r)];
}

void SymmHeap::unlink_own() { own_header_.unlink(); }

// A peer process that is gone, or a zombie not yet reaped by its parent (e.g. a launcher that
// is itself blocked), counts as dead.
bool SymmHeap::peer_alive(int32_t r) const {
  const pid_t pid = pid_t(peer_pid(r));
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
    // A peer that stopped this call (PeerFlag::Fault), preferably one that names a rank whose
    // exit it noticed: that exit is the root cause, whichever rank noticed it first, and every
    // rank's error names it (even when the noticing peer has exited since, after its error).
    int32_t f = -1, named = -1;
    if (site != WaitSite::PeerRearm) {
      for (int32_t s = 0; s < world_ && named < 0; ++s) {
        if (s == rank_ ||
            flag_acquire(header_flag(header(rank_), world_, PeerFlag::Fault, s)) <= round_)
          continue;
        const int32_t d = fault_named(s);
        if (f < 0 || d >= 0) f = s, named = d;
      }
    }
    if (named < 0 && peer_site && index >= 0 && index < world_ && !peer_alive(int32_t(index))) {
      note_exit(int32_t(index));
      msg << "comet: rank " << rank_ << " waiting for " << wait_site_name(site) << " (call "
          << epoch << "): rank " << index << " (pid " << peer_pid(int32_t(index))
          << ") has exited";
      throw std::runtime_error(msg.str());
    }
    if (f >= 0) {
      if (named < 0) named = dead_peer();  // f failed for its own reasons: a dead peer first
      msg << "comet: rank " << rank_ << " stopped waiting for " << wait_site_name(site)
          << " (index " << index << ", call " << epoch << "): ";
      if (named >= 0) {
        note_exit(named);
        msg << "rank " << named << " (pid " << peer_pid(named) << ") has exited";
        if (named != f) msg << " (rank " << f << " noticed it and stopped this call)";
      } else {
        msg << "rank " << f
            << " stopped this call (it failed, its error says why, or called "
               "Buffer.recover()); the next call re-arms the buffer";
      }
      throw std::runtime_error(msg.str());
    }
    if (waited > timeout_s_) {
      msg << "comet: rank " << rank_ << " gave up after " << waited << " s waiting for "
          << wait_site_name(site) << " (index " << index << ", call " << epoch << "); ";
      const int32_t d = exit_cause();
      if (d >= 0) {
        note_exit(d);
        msg << "rank " << d << " (pid " << peer_pid(d) << ") has exited";
      } else {
        msg << "a peer may have died, stalled, or called a different op "
               "(timeout set by COMET_TIMEOUT or Buffer(timeout=...))";
      }
      throw std::runtime_error(msg.str());
    }
  }
}

uint64_t SymmHeap::begin_call(CallMeta me) {
  recover_if_needed();
  const uint64_t e = ++epoch_;
  RankHeader* mine = header(rank_);
  try {
    for (int32_t s = 0; s < world_; ++s)
      wait(header_flag(mine, world_, PeerFlag::Done, s), e - 1, WaitSite::PeerDone, s);
    me.epoch = e;
    mine->meta = me;  // the source of the puts below: unchanged until the next call
    for (int32_t r = 0; r < world_; ++r) {
      CallMeta* box = header_meta_box(header(reachable(r) ? r : rank_), world_, rank_);
      if (reachable(r)) {
        *box = me;
        flag_release(header_flag(header(r), world_, PeerFlag::Meta, rank_), e);
      } else {
        proxy_->put_signal(r, box, &mine->meta, sizeof(CallMeta),
                           header_flag(mine, world_, PeerFlag::Meta, rank_), e);
      }
    }
    metas_.resize(world_);
    for (int32_t s = 0; s < world_; ++s) {
      wait(header_flag(mine, world_, PeerFlag::Meta, s), e, WaitSite::PeerMeta, s);
      metas_[s] = *header_meta_box(mine, world_, s);
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
  if (bytes > requested_) requested_ = bytes;
  if (bytes <= capacity_) return;
  const size_t cap = grow_size_within(bytes, capacity_, 1, data_limit_);
  if (cap == 0) {
    std::ostringstream m;
    m << "comet.buffers.symm: this call needs a data segment of " << bytes
      << " bytes per rank, more than the heap's cap of " << data_limit_
      << " bytes (Buffer(heap_bytes=) / $COMET_CPU_HEAP_BYTES, the CPU analog of "
         "NVSHMEM_SYMMETRIC_SIZE); the buffer keeps its "
      << capacity_ << " bytes and serves the calls that fit";
    throw SegmentRefused(m.str());
  }
  try {
    // The old generation goes before the new one exists, so a rank never holds both (the peak is
    // the new size, not old + new). Nothing refers to it any more: every peer finished reading
    // this rank's memory in the previous call (begin_call waited for their Done, sent after
    // their puts were delivered), and no rank writes this call's data before every rank mapped
    // the new generation (the Mapped waits below).
    drop_data_segments();
    ++gen_;
    own_data_ = ShmSegment::create(segment_name(rank_, "d", gen_), cap);
    data_[rank_] = own_data_.data();
    if (proxy_) proxy_->set_own(own_header_.data(), own_header_.size(), own_data_.data(), cap);
    for (int32_t r = 0; r < world_; ++r)
      if (r != rank_) send_flag(r, PeerFlag::Gen, gen_);
    RankHeader* mine = header(rank_);
    for (int32_t s = 0; s < world_; ++s) {
      if (s == rank_) continue;
      wait(header_flag(mine, world_, PeerFlag::Gen, s), gen_, WaitSite::PeerGeneration, s);
      ShmSegment seg = ShmSegment::open(segment_name(s, "d", gen_), cap);
      if (reachable(s)) {
        peer_data_[s] = std::move(seg);
        data_[s] = peer_data_[s].data();
      } else {
        proxy_->map_data(s, std::move(seg));
      }
      send_flag(s, PeerFlag::Mapped, gen_);
    }
    for (int32_t s = 0; s < world_; ++s)
      if (s != rank_) wait(header_mapped(mine, world_, s), gen_, WaitSite::PeerMapped, s);
    own_data_.unlink();
    capacity_ = cap;
  } catch (const std::exception& ex) {
    mark_broken(ex.what());
    throw;
  }
}

// Every put of this call is delivered before "done" goes out (the link is FIFO anyway; quiet also
// frees the put sources for the next call).
void SymmHeap::end_call(uint64_t epoch) {
  if (proxy_) proxy_->quiet();
  flag_release(header(rank_)->done_epoch, epoch);
  for (int32_t r = 0; r < world_; ++r) send_flag(r, PeerFlag::Done, epoch);
}

void SymmHeap::mark_broken(const std::string& why) {
  own_header_.unlink();
  own_data_.unlink();
  if (!broken_.empty()) return;
  broken_ = why;
  // Peers still waiting on this call give up at once instead of after the timeout; peers not in
  // a call re-arm at their next one. If a peer's process is gone (what this call most likely
  // failed on), the fault names it, so every peer's error names the root cause, not this rank.
  // Best effort: a link that fails here fails the re-arm later.
  try {
    send_fault(round_ + 1, exit_cause());
  } catch (const std::exception&) {
  }
}

void SymmHeap::send_fault(uint64_t round, int32_t dead) {
  // Word 1 of the Fault line (symm_layout.h), written before the flag: by stores on this node,
  // in the same put as the signal across nodes (the link delivers the bytes before the signal;
  // it reads them from this rank's own line then, so that line changes only when the rank does).
  uint64_t* own_line = header_flag(header(rank_), world_, PeerFlag::Fault, rank_);
  const uint64_t named = uint64_t(dead + 1);
  if (flag_relaxed(own_line + 1) != named) flag_release(own_line + 1, named);
  for (int32_t r = 0; r < world_; ++r) {
    if (r == rank_) continue;
    if (reachable(r)) {
      uint64_t* line = header_flag(header(r), world_, PeerFlag::Fault, rank_);
      flag_release(line + 1, named);
      flag_release(line, round);
    } else {
      proxy_->put_signal(r, own_line + 1, own_line + 1, sizeof(uint64_t), own_line, round);
    }
  }
}

int32_t SymmHeap::dead_peer() const {
  for (int32_t s = 0; s < world_; ++s)
    if (s != rank_ && !peer_alive(s)) return s;
  return -1;
}

int32_t SymmHeap::fault_named(int32_t s) const {
  uint64_t* line = header_flag(header(rank_), world_, PeerFlag::Fault, s);
  if (flag_acquire(line) <= round_) return -1;  // no fault of this round (acquire: word 1 next)
  const uint64_t named = flag_relaxed(line + 1);
  if (named >= 1 && named <= uint64_t(world_) && int32_t(named - 1) != rank_)
    return int32_t(named - 1);
  return -1;
}

int32_t SymmHeap::exit_cause() const {
  const int32_t seen = exit_seen_.load(std::memory_order_acquire);
  if (seen >= 0) return seen;
  for (int32_t s = 0; s < world_; ++s) {
    const int32_t d = s == rank_ ? -1 : fault_named(s);
    if (d >= 0) return d;
  }
  return dead_peer();
}

void SymmHeap::note_exit(int32_t r) const {
  int32_t none = -1;
  exit_seen_.compare_exchange_strong(none, r, std::memory_order_acq_rel);
}

int32_t SymmHeap::faulted_peer() const {
  RankHeader* mine = header(rank_);
  for (int32_t s = 0; s < world_; ++s)
    if (s != rank_ && flag_relaxed(header_flag(mine, world_, PeerFlag::Fault, s)) > round_)
      return s;
  return -1;
}

bool SymmHeap::needs_rearm() const { return !broken_.empty() || faulted_peer() >= 0; }

void SymmHeap::check_usable() const {
  if (!dead_.empty())
    throw std::runtime_error("comet: this buffer cannot be used again: " + dead_ +
                             ". A dead rank ends the group: restart the job (or build a new "
                             "process group of the live ranks and a new comet.Buffer on it)");
}

void SymmHeap::recover_if_needed() {
  check_usable();
  if (needs_rearm()) rearm();
}

void SymmHeap::recover() {
  check_usable();
  rearm();
}

void SymmHeap::drop_data_segments() {
  if (proxy_) proxy_->set_own(own_header_.data(), own_header_.size(), nullptr, 0);
  for (int32_t r = 0; r < world_; ++r) {
    data_[size_t(r)] = nullptr;
    peer_data_[size_t(r)] = ShmSegment{};
  }
  own_data_ = ShmSegment{};
  capacity_ = 0;
}

// A peer process that is gone makes the heap dead for good (its segments and flags will never
// answer again).
void SymmHeap::check_peers_alive() {
  if (dead_peer() < 0) return;
  const int32_t s = exit_cause();  // the root cause if a wait or a peer's fault named one
  std::ostringstream why;
  why << "rank " << s << " (pid " << peer_pid(s) << ") has exited";
  if (!broken_.empty()) why << " (the failed call: " << broken_ << ")";
  dead_ = why.str();
  // Peers still waiting in a call (for this rank, which will not come) stop now, naming rank s.
  try {
    send_fault(round_ + 1, s);
  } catch (const std::exception&) {
  }
  check_usable();
}

void SymmHeap::rearm() {
  check_peers_alive();
  const uint64_t target = round_ + 1;
  RankHeader* mine = header(rank_);
  try {
    // Every put this rank issued (late ones of the failed call included) lands before its Rearm
    // signal (the link is FIFO), and its blocks have all returned: after the waits below, no write
    // from before the re-arm is still on its way to this rank.
    if (proxy_) proxy_->quiet();
    send_fault(target, -1);
    uint64_t* own_line = header_flag(mine, world_, PeerFlag::Rearm, rank_);
    *reinterpret_cast<RearmState*>(own_line + 1) = RearmState{epoch_, gen_, uint64_t(capacity_)};
    for (int32_t r = 0; r < world_; ++r) {
      if (r == rank_) continue;
      if (reachable(r)) {
        uint64_t* line = header_flag(header(r), world_, PeerFlag::Rearm, rank_);
        *reinterpret_cast<RearmState*>(line + 1) = *reinterpret_cast<RearmState*>(own_line + 1);
        flag_release(line, target);
      } else {
        proxy_->put_signal(r, own_line + 1, own_line + 1, sizeof(RearmState), own_line, target);
      }
    }
    RearmState group{epoch_, gen_, uint64_t(capacity_)};
    bool same_segment = true;
    for (int32_t s = 0; s < world_; ++s) {
      if (s == rank_) continue;
      uint64_t* line = header_flag(mine, world_, PeerFlag::Rearm, s);
      wait(line, target, WaitSite::PeerRearm, s);
      const RearmState peer = *reinterpret_cast<const RearmState*>(line + 1);
      same_segment = same_segment && peer.gen == gen_ && peer.capacity == capacity_;
      group.epoch = std::max(group.epoch, peer.epoch);
      group.gen = std::max(group.gen, peer.gen);
    }
    // A grow that failed half-way leaves ranks on different segments: drop them all; the next
    // call grows to a generation no rank has used.
    if (!same_segment) drop_data_segments();
    gen_ = group.gen;
    epoch_ = group.epoch;
    // The counters a failed call may have left mid-count; tile_flags_ hold epochs (all below the
    // next call's).
    std::fill(tile_counts_.begin(), tile_counts_.end(), 0u);
    std::fill(chunk_counts_.begin(), chunk_counts_.end(), 0u);
    blocks_done_ = 0;
    // Every rank is past its failed call: none reads peers' memory any more (the next call's
    // "previous call done" handshake).
    flag_release(mine->done_epoch, epoch_);
    for (int32_t r = 0; r < world_; ++r) send_flag(r, PeerFlag::Done, epoch_);
  } catch (const std::exception& ex) {
    if (broken_.empty()) broken_ = ex.what();
    check_peers_alive();
    throw std::runtime_error(std::string("comet: re-arming the buffer after a failed call did "
                                         "not complete (every rank must make its next call or "
                                         "call Buffer.recover()): ") + ex.what());
  }
  round_ = target;
  broken_.clear();
}

namespace {
HandleRegistry<SymmHeap> g_heaps(1);
}  // namespace

int64_t register_heap(std::shared_ptr<SymmHeap> heap) { return g_heaps.add(std::move(heap)); }

std::shared_ptr<SymmHeap> find_heap(int64_t handle) {
  std::shared_ptr<SymmHeap> heap = g_heaps.find(handle);
  if (heap == nullptr)
    throw std::invalid_argument("comet: no live buffer with handle " + std::to_string(handle) +
                                " (closed, or not created by comet.buffers.symm)");
  return heap;
}

void release_heap(int64_t handle) { g_heaps.take(handle); }

}  // namespace comet::cpu
