// The POSIX file calls a durable file replacement makes, behind an interface so that tests can fail
// any one of them (a full disk at the Nth write, a failed fsync) without a real full disk.
#ifndef SHARDSERVE_SERVER_COORDINATOR_FILE_OPS_H_
#define SHARDSERVE_SERVER_COORDINATOR_FILE_OPS_H_

#include <sys/types.h>

#include <cstddef>
#include <string>

namespace shardserve::server {

// Each call returns what its POSIX namesake returns on success, or -errno on failure (never -1
// with errno set). Thread-safe.
class FileOps {
 public:
  virtual ~FileOps() = default;
  // The real calls (open(2), read(2), ...); lives forever.
  static FileOps& Posix();

  virtual int Open(const std::string& path, int flags, mode_t mode) = 0;  // a descriptor
  virtual ssize_t Read(int fd, char* data, size_t size) = 0;
  virtual ssize_t Write(int fd, const char* data, size_t size) = 0;
  virtual int Fsync(int fd) = 0;
  virtual int Close(int fd) = 0;
  virtual int Rename(const std::string& from, const std::string& to) = 0;
  virtual int Unlink(const std::string& path) = 0;
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_COORDINATOR_FILE_OPS_H_
