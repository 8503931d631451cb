#include "backend/shm_segment.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

namespace torch_tp::backend {
namespace {

// Closes a file descriptor on every path out of create/open.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) {
      ::close(fd);
    }
  }
};

void* map(int fd, size_t bytes, const std::string& name) {
  void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  TORCH_CHECK(data != MAP_FAILED, "torch_tp backend: mmap of /dev/shm", name, " (", bytes, " bytes) failed: ",
              std::strerror(errno));
  return data;
}

} // namespace

size_t shm_free_bytes() {
  struct statvfs info {};
  if (::statvfs("/dev/shm", &info) != 0) {
    return 0;
  }
  return static_cast<size_t>(info.f_bavail) * static_cast<size_t>(info.f_frsize);
}

ShmSegment ShmSegment::create(const std::string& name, size_t bytes) {
  const size_t free = shm_free_bytes();
  TORCH_CHECK(free >= bytes, "torch_tp backend: /dev/shm has ", free, " bytes free but each rank needs ", bytes,
              " bytes; free space in /dev/shm (e.g. docker --shm-size) or lower TORCH_TP_SHM_BUFFER_BYTES");
  Fd fd{::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)};
  TORCH_CHECK(fd.fd >= 0, "torch_tp backend: shm_open(", name, ") failed: ", std::strerror(errno));
  ShmSegment segment(name, nullptr, 0, /*owner=*/true);  // unlinks on any error below
  int rc = ::ftruncate(fd.fd, static_cast<off_t>(bytes));
  TORCH_CHECK(rc == 0, "torch_tp backend: ftruncate of /dev/shm", name, " to ", bytes,
              " bytes failed: ", std::strerror(errno));
  rc = ::posix_fallocate(fd.fd, 0, static_cast<off_t>(bytes));
  TORCH_CHECK(rc == 0, "torch_tp backend: reserving ", bytes, " bytes in /dev/shm for ", name,
              " failed: ", std::strerror(rc), "; free space in /dev/shm or lower TORCH_TP_SHM_BUFFER_BYTES");
  segment.data_ = map(fd.fd, bytes, name);
  segment.size_ = bytes;
  return segment;
}

ShmSegment ShmSegment::open(const std::string& name, size_t bytes) {
  Fd fd{::shm_open(name.c_str(), O_RDWR, 0600)};
  TORCH_CHECK(fd.fd >= 0, "torch_tp backend: shm_open(", name, ") of a peer's segment failed: ",
              std::strerror(errno));
  struct stat info {};
  TORCH_CHECK(::fstat(fd.fd, &info) == 0 && static_cast<size_t>(info.st_size) == bytes,
              "torch_tp backend: the peer segment /dev/shm", name, " has ", info.st_size, " bytes, expected ", bytes,
              " (do the ranks agree on TORCH_TP_SHM_BUFFER_BYTES?)");
  return ShmSegment(name, map(fd.fd, bytes, name), bytes, /*owner=*/false);
}

ShmSegment::ShmSegment(std::string name, void* data, size_t size, bool owner)
    : name_(std::move(name)), data_(data), size_(size), linked_(owner) {}

ShmSegment::ShmSegment(ShmSegment&& other) noexcept
    : name_(std::move(other.name_)), data_(other.data_), size_(other.size_), linked_(other.linked_) {
  other.data_ = nullptr;
  other.size_ = 0;
  other.linked_ = false;
}

ShmSegment& ShmSegment::operator=(ShmSegment&& other) noexcept {
  if (this != &other) {
    release();
    name_ = std::move(other.name_);
    data_ = other.data_;
    size_ = other.size_;
    linked_ = other.linked_;
    other.data_ = nullptr;
    other.size_ = 0;
    other.linked_ = false;
  }
  return *this;
}

ShmSegment::~ShmSegment() {
  release();
}

void ShmSegment::unlink() {
  if (linked_) {
    ::shm_unlink(name_.c_str());
    linked_ = false;
  }
}

void ShmSegment::release() {
  unlink();
  if (data_ != nullptr) {
    ::munmap(data_, size_);
    data_ = nullptr;
    size_ = 0;
  }
}

} // namespace torch_tp::backend
