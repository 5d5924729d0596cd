#include "link_proxy.h"

#include <cstring>
#include <stdexcept>

#include "comet/flags.h"

namespace comet::cpu {

LinkProxy::LinkProxy(int32_t world, LinkSettings link)
    : world_(world), link_(link), headers_(size_t(world)), datas_(size_t(world)),
      link_free_(std::chrono::steady_clock::now()), server_([this] { serve(); }) {}

LinkProxy::~LinkProxy() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  server_.join();
}

void LinkProxy::set_own(const char* header, size_t header_bytes, const char* data,
                        size_t data_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  own_header_ = header;
  own_header_bytes_ = header_bytes;
  own_data_ = data;
  own_data_bytes_ = data_bytes;
}

void LinkProxy::map_header(int32_t rank, ShmSegment seg) {
  std::lock_guard<std::mutex> lock(mu_);
  headers_[size_t(rank)] = std::move(seg);
}

// Called between calls (SymmHeap::reserve), when this rank has no request in flight.
void LinkProxy::map_data(int32_t rank, ShmSegment seg) {
  std::lock_guard<std::mutex> lock(mu_);
  datas_[size_t(rank)] = std::move(seg);
}

uint64_t LinkProxy::read_header_word(int32_t rank, size_t offset) const {
  const ShmSegment& h = headers_[size_t(rank)];
  if (!h.data() || offset + 8 > h.size())
    throw std::logic_error("comet: link proxy has no header of rank " + std::to_string(rank));
  return flag_acquire(reinterpret_cast<uint64_t*>(h.data() + offset));
}

void LinkProxy::put_signal(int32_t rank, const void* dst, const void* src, size_t bytes,
                           const uint64_t* sig, uint64_t value) {
  Request r{rank, false, -1, src, bytes, -1, value, {}};
  if (bytes > 0) {
    const char* d = static_cast<const char*>(dst);
    if (d >= own_data_ && d + bytes <= own_data_ + own_data_bytes_) {
      r.dst_off = d - own_data_;
    } else if (d >= own_header_ && d + bytes <= own_header_ + own_header_bytes_) {
      r.dst_header = true;
      r.dst_off = d - own_header_;
    } else {
      throw std::logic_error("comet: put destination outside the symmetric segments");
    }
  }
  if (sig) {
    const char* s = reinterpret_cast<const char*>(sig);
    if (s < own_header_ || s + 8 > own_header_ + own_header_bytes_)
      throw std::logic_error("comet: signal outside the symmetric header");
    r.sig_off = s - own_header_;
  }
  r.due = std::chrono::steady_clock::now() +
          std::chrono::nanoseconds(int64_t(link_.latency_us * 1000.0));
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(r);
    issued_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_one();
}

void LinkProxy::quiet() {
  std::unique_lock<std::mutex> lock(mu_);
  const uint64_t target = issued_.load(std::memory_order_acquire);
  drained_.wait(lock, [&] { return delivered_.load(std::memory_order_acquire) >= target; });
  if (!error_.empty()) throw std::runtime_error(error_);
}

void LinkProxy::deliver(const Request& r) {
  if (r.dst_off >= 0) {
    const ShmSegment& d = (r.dst_header ? headers_ : datas_)[size_t(r.rank)];
    if (!d.data() || size_t(r.dst_off) + r.bytes > d.size())
      throw std::logic_error("comet: link proxy: put beyond rank " + std::to_string(r.rank) +
                             "'s segment");
    std::memcpy(d.data() + r.dst_off, r.src, r.bytes);
    bytes_.fetch_add(r.bytes, std::memory_order_relaxed);
  }
  if (r.sig_off >= 0) {
    const ShmSegment& h = headers_[size_t(r.rank)];
    flag_release(reinterpret_cast<uint64_t*>(h.data() + r.sig_off), r.value);
  }
}

void LinkProxy::serve() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stop_ and nothing left
    const Request r = queue_.front();
    queue_.pop_front();
    lock.unlock();
    // FIFO: the latency is the same for every request, so the head is always due first; the
    // link is busy for bytes / bandwidth after the previous delivery.
    auto at = r.due;
    if (link_.gbps > 0) {
      link_free_ = std::max(link_free_, r.due) +
                   std::chrono::nanoseconds(int64_t(double(r.bytes) / link_.gbps));
      at = link_free_;
    }
    std::this_thread::sleep_until(at);
    std::string failed;
    try {
      deliver(r);
    } catch (const std::exception& e) {
      failed = e.what();  // reported by quiet(); counted delivered so that quiet() cannot hang
    }
    lock.lock();
    if (!failed.empty() && error_.empty()) error_ = failed;
    delivered_.fetch_add(1, std::memory_order_release);
    drained_.notify_all();
  }
}

}  // namespace comet::cpu
