#include "server/coordinator/file_ops.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>

namespace shardserve::server {
namespace {

// -errno where the call failed, its result otherwise; interrupted calls are made again.
template <typename Call>
auto Retried(Call call) -> decltype(call()) {
  while (true) {
    const auto result = call();
    if (result >= 0) return result;
    if (errno != EINTR) return -errno;
  }
}

class PosixFileOps final : public FileOps {
 public:
  int Open(const std::string& path, int flags, mode_t mode) override {
    return Retried([&] { return ::open(path.c_str(), flags, mode); });
  }
  ssize_t Read(int fd, char* data, size_t size) override {
    return Retried([&] { return ::read(fd, data, size); });
  }
  ssize_t Write(int fd, const char* data, size_t size) override {
    return Retried([&] { return ::write(fd, data, size); });
  }
  int Fsync(int fd) override {
    return Retried([&] { return ::fsync(fd); });
  }
  int Close(int fd) override {
    // Not retried: Linux frees the descriptor even when close fails (EINTR included).
    return ::close(fd) == 0 ? 0 : -errno;
  }
  int Rename(const std::string& from, const std::string& to) override {
    return std::rename(from.c_str(), to.c_str()) == 0 ? 0 : -errno;
  }
  int Unlink(const std::string& path) override {
    return ::unlink(path.c_str()) == 0 ? 0 : -errno;
  }
};

}  // namespace

FileOps& FileOps::Posix() {
  static PosixFileOps* const files = new PosixFileOps;
  return *files;
}

}  // namespace shardserve::server
