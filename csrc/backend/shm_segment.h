#pragma once
// One POSIX shared-memory segment (/dev/shm/<name>), mapped read-write.
//
// NOTE [segment lifetime]
// A segment's name lives in /dev/shm only between its creation and the
// moment every local rank has mapped it: the creator unlinks it then (see
// ShmTransport's constructor). The memory stays valid while any mapping
// exists, so a crash at any later point leaves nothing behind in /dev/shm.

#include <cstddef>
#include <string>

namespace torch_tp::backend {

class ShmSegment {
 public:
  // Creates /dev/shm/<name> of `bytes` bytes and reserves its pages, so a full
  // /dev/shm is a clear error here rather than a SIGBUS on first touch.
  static ShmSegment create(const std::string& name, size_t bytes);
  // Maps an existing segment, which must be `bytes` long.
  static ShmSegment open(const std::string& name, size_t bytes);

  ShmSegment() = default;
  ShmSegment(ShmSegment&& other) noexcept;
  ShmSegment& operator=(ShmSegment&& other) noexcept;
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;
  ~ShmSegment();  // unmaps; unlinks too if this process created it and has not yet

  void* data() const {
    return data_;
  }
  size_t size() const {
    return size_;
  }
  const std::string& name() const {
    return name_;
  }
  // Removes the name from /dev/shm (the mapping stays valid). Idempotent.
  void unlink();

 private:
  ShmSegment(std::string name, void* data, size_t size, bool owner);
  void release();

  std::string name_;
  void* data_ = nullptr;
  size_t size_ = 0;
  bool linked_ = false;  // this process created the name and has not unlinked it
};

// Bytes free in /dev/shm for an unprivileged user.
size_t shm_free_bytes();

} // namespace torch_tp::backend
