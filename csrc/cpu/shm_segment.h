// One POSIX shared-memory segment: created by its owner, mapped by every rank of the group.
// The owner unlinks the name as soon as every peer has mapped it, so nothing is left in /dev/shm
// even if a process dies later; the mappings stay valid until unmapped.
#pragma once

#include <cstddef>
#include <string>

namespace comet::cpu {

class ShmSegment {
 public:
  ShmSegment() = default;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ShmSegment(ShmSegment&& o) noexcept { *this = std::move(o); }
  ShmSegment& operator=(ShmSegment&& o) noexcept;
  ~ShmSegment() { reset(); }

  // Owner: create the name (must not exist), size it and map it zero-filled.
  static ShmSegment create(const std::string& name, size_t bytes);
  // Peer: map an existing name.
  static ShmSegment open(const std::string& name, size_t bytes);

  void unlink();  // remove the name (owner); idempotent
  void reset();   // unmap (and unlink if still owned and linked)
  char* data() const { return base_; }
  size_t size() const { return bytes_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  char* base_ = nullptr;
  size_t bytes_ = 0;
  bool linked_ = false;  // we created it and have not unlinked it yet
};

}  // namespace comet::cpu
