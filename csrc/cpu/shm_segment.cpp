#include "shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace comet::cpu {

namespace {
[[noreturn]] void fail(const std::string& what, const std::string& name) {
  throw std::runtime_error("comet.buffers.symm: " + what + " '" + name + "': " + std::strerror(errno));
}

char* map_fd(int fd, size_t bytes, const std::string& name) {
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (p == MAP_FAILED) {
    int saved = errno;
    close(fd);
    errno = saved;
    fail("mmap failed for", name);
  }
  close(fd);
  return static_cast<char*>(p);
}
}  // namespace

ShmSegment& ShmSegment::operator=(ShmSegment&& o) noexcept {
  if (this != &o) {
    reset();
    name_ = std::move(o.name_);
    base_ = o.base_;
    bytes_ = o.bytes_;
    linked_ = o.linked_;
    o.base_ = nullptr;
    o.bytes_ = 0;
    o.linked_ = false;
  }
  return *this;
}

ShmSegment ShmSegment::create(const std::string& name, size_t bytes) {
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) fail("cannot create shared memory", name);
  if (ftruncate(fd, off_t(bytes)) != 0) {
    int saved = errno;
    close(fd);
    shm_unlink(name.c_str());
    errno = saved;
    fail("cannot size shared memory", name);
  }
  ShmSegment s;
  s.name_ = name;
  s.linked_ = true;
  s.bytes_ = bytes;
  try {
    s.base_ = map_fd(fd, bytes, name);
  } catch (...) {
    shm_unlink(name.c_str());
    throw;
  }
  return s;
}

ShmSegment ShmSegment::open(const std::string& name, size_t bytes) {
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) fail("cannot open peer shared memory", name);
  ShmSegment s;
  s.name_ = name;
  s.bytes_ = bytes;
  s.base_ = map_fd(fd, bytes, name);
  return s;
}

void ShmSegment::unlink() {
  if (linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

void ShmSegment::reset() {
  unlink();
  if (base_) munmap(base_, bytes_);
  base_ = nullptr;
  bytes_ = 0;
}

}  // namespace comet::cpu
