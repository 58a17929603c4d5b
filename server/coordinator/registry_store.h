// The coordinator's table registry on disk (<state_dir>/tables.pb): read once at start, replaced
// durably on every change. A save writes a temporary file beside it, flushes it to the disk
// (fsync), renames it over the registry and fsyncs the directory, checking every step; a save that
// fails leaves the file as it was, so that a full disk can never truncate the registry.
#ifndef SHARDSERVE_SERVER_COORDINATOR_REGISTRY_STORE_H_
#define SHARDSERVE_SERVER_COORDINATOR_REGISTRY_STORE_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/internal.pb.h"
#include "server/coordinator/file_ops.h"

namespace shardserve::server {

// Thread-compatible: one caller at a time (the control plane calls it under its lock). Owns
// nothing but the file's path and a copy of the bytes it holds; `files` must outlive it.
class RegistryStore {
 public:
  // A store in `dir`, which must be a directory: INVALID_ARGUMENT (names it and why) otherwise.
  static absl::StatusOr<std::unique_ptr<RegistryStore>> Open(const std::string& dir,
                                                             FileOps& files = FileOps::Posix());

  const std::string& path() const { return path_; }

  // The registry as last saved; an empty one if there is none yet (first start). DATA_LOSS when
  // the file is empty, truncated or garbled, INTERNAL when it cannot be read (both name the file
  // and what went wrong).
  absl::StatusOr<v1::internal::TableRegistry> Load();

  // Replaces the registry with `registry`. On failure nothing has changed on disk (where a step
  // after the rename fails, the previous registry is written back; the message says if even that
  // failed): RESOURCE_EXHAUSTED when the disk or the quota is full, INTERNAL otherwise; the
  // message names the file and the system's error text.
  absl::Status Save(const v1::internal::TableRegistry& registry);

 private:
  RegistryStore(std::string dir, FileOps& files);
  // Writes `bytes` to the temporary file and renames it over the registry. `renamed` tells whether
  // the registry file was replaced (the failure, if any, came after that).
  absl::Status Replace(const std::string& bytes, bool* renamed);

  const std::string dir_;
  const std::string path_;  // dir_/tables.pb
  const std::string tmp_;   // dir_/tables.pb.tmp
  FileOps& files_;
  bool exists_ = false;  // whether path_ holds on_disk_ (false: no registry file yet)
  std::string on_disk_;
};

}  // namespace shardserve::server

#endif  // SHARDSERVE_SERVER_COORDINATOR_REGISTRY_STORE_H_
