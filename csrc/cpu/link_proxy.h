// The CPU analog of the inter-node link: the only way a rank's data reaches a rank on another node.
//
// Ranks on other nodes are NOT mapped into what the ranks' code sees (SymmHeap::data()/header()
// return null for them, so a stray pointer access crashes instead of silently working). The proxy
// owns mappings of those ranks' header and data segments (the NIC's registered windows) and serves
// put-with-signal requests on its own thread, in issue order, each delivered no earlier than
// `latency` after it was issued and at most at `bandwidth` bytes per second:
//   put_signal(rank, dst, src, bytes, sig, value)
//     dst (in the data segment or the header) and sig (in the header) are addresses of the same
//     symmetric object in the ISSUING rank's own segments (NVSHMEM's convention); the proxy copies `bytes` from src into rank's copy, then stores
//     `value` into rank's copy of flag `sig` with release. Non-blocking: src must stay unchanged
//     until quiet().
//   quiet()   returns once every request issued so far is delivered; throws if a delivery failed
//             (a request outside the target's segments: a bug, never silently dropped).
// Delivery is FIFO per proxy, so a signal also covers every earlier put to the same rank (what
// nvshmem_fence + signal gives on the GPU).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shm_segment.h"

namespace comet::cpu {

struct LinkSettings {
  double latency_us = 0;  // one-way delivery delay of every request
  double gbps = 0;        // bytes per ns (= GB/s) of the link; 0: as fast as memcpy
};

class LinkProxy {
 public:
  LinkProxy(int32_t world, LinkSettings link);
  ~LinkProxy();
  LinkProxy(const LinkProxy&) = delete;
  LinkProxy& operator=(const LinkProxy&) = delete;

  const LinkSettings& link() const { return link_; }

  // The issuing rank's own segments (to translate its symmetric addresses into offsets).
  void set_own(const char* header, size_t header_bytes, const char* data, size_t data_bytes);
  // A remote rank's segments, mapped by the proxy only.
  void map_header(int32_t rank, ShmSegment seg);
  void map_data(int32_t rank, ShmSegment seg);
  // Blocking read of a remote header word (connection set-up only: the peer's pid).
  uint64_t read_header_word(int32_t rank, size_t offset) const;

  void put_signal(int32_t rank, const void* dst, const void* src, size_t bytes, const uint64_t* sig,
                  uint64_t value);
  void quiet();
  // Requests issued / delivered so far (tests and benchmarks).
  uint64_t issued() const { return issued_.load(std::memory_order_acquire); }
  uint64_t bytes_sent() const { return bytes_.load(std::memory_order_relaxed); }

 private:
  struct Request {
    int32_t rank;
    bool dst_header;  // dst_off into the header (else into the data segment)
    int64_t dst_off;  // -1: no data
    const void* src;
    size_t bytes;
    int64_t sig_off;  // into the header; -1: no signal
    uint64_t value;
    std::chrono::steady_clock::time_point due;
  };
  void serve();
  void deliver(const Request& r);

  const int32_t world_;
  const LinkSettings link_;
  const char* own_header_ = nullptr;
  size_t own_header_bytes_ = 0;
  const char* own_data_ = nullptr;
  size_t own_data_bytes_ = 0;
  std::vector<ShmSegment> headers_, datas_;

  std::mutex mu_;
  std::condition_variable cv_;       // wakes the server
  std::condition_variable drained_;  // wakes quiet()
  std::deque<Request> queue_;
  std::string error_;  // first failed delivery
  bool stop_ = false;
  std::atomic<uint64_t> issued_{0}, delivered_{0}, bytes_{0};
  std::chrono::steady_clock::time_point link_free_;
  std::thread server_;
};

}  // namespace comet::cpu
