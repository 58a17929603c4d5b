// safetensors files (https://github.com/huggingface/safetensors format): an 8-byte little-endian
// header length, a JSON header {"name": {"dtype", "shape", "data_offsets"}, ...}, then raw data.
//
// SafetensorsFile maps a file read-only (mmap) and hands out views of its tensors, so a rank
// copies only its own slice of a large checkpoint. Thread-compatible; views live as long as the
// SafetensorsFile. Errors: NOT_FOUND (no file), INVALID_ARGUMENT (a relative path; a FIFO, socket,
// directory or device; malformed: says what and where). Opening never waits (OpenRegularFile).
#ifndef SHARDSERVE_CORE_TABLE_SAFETENSORS_H_
#define SHARDSERVE_CORE_TABLE_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace shardserve::core {

struct SafetensorsTensor {
  std::string dtype;  // "F32", "I64", ...
  std::vector<int64_t> shape;
  const char* data = nullptr;
  int64_t bytes = 0;
};

// Opens `path` for reading if it is a regular file (or a symbolic link to one), without waiting
// on anything (a FIFO's writer, a device): returns the file descriptor (O_CLOEXEC; the caller
// closes it), or INVALID_ARGUMENT for a relative path or anything but a regular file (the message
// says what it is), NOT_FOUND when nothing is there. Messages start with `what` and the path.
absl::StatusOr<int> OpenRegularFile(const std::string& path, absl::string_view what);

class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();

  // Null when the file has no tensor of that name.
  const SafetensorsTensor* Find(const std::string& name) const;
  const std::map<std::string, SafetensorsTensor>& tensors() const { return tensors_; }
  // Drops the mapped pages of [begin, begin + bytes) from this process's memory (the data stays
  // readable; it is paged in again on access). Lets a reader stream a large file in bounded RSS.
  void Release(const char* begin, int64_t bytes) const;
  // Copies the file's bytes at [begin, begin + bytes) of the mapping into `out` with pread,
  // without touching the mapping: no page faults, so a loader that is preempted holds nothing
  // other threads wait for (a fault holds the process's memory map). INTERNAL when it cannot.
  absl::Status Read(const char* begin, int64_t bytes, void* out) const;

 private:
  SafetensorsFile() = default;
  int fd_ = -1;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::map<std::string, SafetensorsTensor> tensors_;
};

struct SafetensorsEntry {
  std::string name;
  std::string dtype;  // "F32"
  std::vector<int64_t> shape;
  const void* data = nullptr;
  int64_t bytes = 0;
};

// INVALID_ARGUMENT unless `path` can name a safetensors file to write: absolute, in a directory
// that exists, and not anything but a regular file already (a device, a directory, a link).
absl::Status CheckOutputPath(const std::string& path);

// What a safetensors file of `entries` holds before their data (which follows in their order):
// the 8-byte header length and the JSON header, padded with spaces so that the data is aligned.
std::string SafetensorsHeader(const std::vector<SafetensorsEntry>& entries);

// Writes the tensors to `path` (atomically: a temporary file renamed into place; nothing is left
// behind when it fails). `path` must pass CheckOutputPath. `durable`: written around the page
// cache (O_DIRECT where the file system has it) and synced to disk before the rename (the caller
// syncs the directory).
absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                              bool durable = false);

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_TABLE_SAFETENSORS_H_
