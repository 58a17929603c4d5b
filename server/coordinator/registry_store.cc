#include "server/coordinator/registry_store.h"

#include <fcntl.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardserve::server {
namespace {

// A full disk (or quota) is a resource the operator can free; anything else is an I/O fault.
absl::Status FileError(int error, const std::string& what) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(error));
  return error == ENOSPC || error == EDQUOT ? absl::ResourceExhaustedError(message)
                                            : absl::InternalError(message);
}

}  // namespace

absl::StatusOr<std::unique_ptr<RegistryStore>> RegistryStore::Open(const std::string& dir,
                                                                   FileOps& files) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--state_dir: cannot use \"", dir, "\": ", std::strerror(errno)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--state_dir: \"", dir, "\" is not a directory"));
  }
  return std::unique_ptr<RegistryStore>(new RegistryStore(dir, files));
}

RegistryStore::RegistryStore(std::string dir, FileOps& files)
    : dir_(std::move(dir)),
      path_(dir_ + "/tables.pb"),
      tmp_(path_ + ".tmp"),
      files_(files) {}

absl::StatusOr<v1::internal::TableRegistry> RegistryStore::Load() {
  v1::internal::TableRegistry registry;
  const int fd = files_.Open(path_, O_RDONLY | O_CLOEXEC, 0);
  if (fd == -ENOENT) {
    exists_ = false;
    on_disk_.clear();
    return registry;  // first start
  }
  if (fd < 0) return FileError(-fd, absl::StrCat("registry: cannot open ", path_));
  std::string bytes;
  char buffer[1 << 16];
  while (true) {
    const ssize_t n = files_.Read(fd, buffer, sizeof(buffer));
    if (n < 0) {
      files_.Close(fd);
      return FileError(-n, absl::StrCat("registry: cannot read ", path_));
    }
    if (n == 0) break;
    bytes.append(buffer, n);
  }
  files_.Close(fd);
  // A file cut short where a field ends still parses. But protobuf writes fields in number order,
  // and every registry saved since tables have generations ends with last_generation: when that
  // is missing while tables have generations, the file was cut short. (An empty file is one too.)
  const bool parsed = !bytes.empty() && registry.ParseFromString(bytes);
  bool cut_short = false;
  if (parsed && registry.last_generation() == 0) {
    for (const v1::TableSpec& spec : registry.tables()) cut_short |= spec.generation() != 0;
  }
  if (!parsed || cut_short) {
    return absl::DataLossError(absl::StrCat(
        "registry: cannot parse ", path_, " (", bytes.size(),
        " bytes): it is truncated or garbled; restore it from a copy, or move it away to start "
        "with no tables"));
  }
  exists_ = true;
  on_disk_ = std::move(bytes);
  return registry;
}

absl::Status RegistryStore::Save(const v1::internal::TableRegistry& registry) {
  std::string bytes;
  if (!registry.SerializeToString(&bytes)) {
    return absl::InternalError(absl::StrCat("registry: cannot serialize it for ", path_));
  }
  bool renamed = false;
  absl::Status status = Replace(bytes, &renamed);
  if (status.ok()) {
    exists_ = true;
    on_disk_ = std::move(bytes);
    return status;
  }
  if (!renamed) return status;
  // The new registry is in place, but not known to be durable: put the previous one back, so that
  // the caller (which keeps its previous state) and the disk agree.
  bool restored_renamed = false;
  const absl::Status restored =
      exists_ ? Replace(on_disk_, &restored_renamed)
              : (files_.Unlink(path_) == 0 ? absl::OkStatus()
                                           : absl::InternalError("cannot remove it"));
  if (restored.ok()) {
    return absl::Status(status.code(),
                        absl::StrCat(status.message(), " (the previous registry is back)"));
  }
  return absl::Status(status.code(),
                      absl::StrCat(status.message(), "; putting the previous registry back failed "
                                   "too (", restored.message(), "): ", path_,
                                   " may hold the new one"));
}

absl::Status RegistryStore::Replace(const std::string& bytes, bool* renamed) {
  *renamed = false;
  // A temporary file left by a crash (or anything else under that name, a link included) goes
  // first: the new one is created afresh, never written through a link.
  files_.Unlink(tmp_);
  const int fd = files_.Open(tmp_, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) return FileError(-fd, absl::StrCat("registry: cannot create ", tmp_));
  auto fail = [&](int error, const std::string& what) {
    files_.Unlink(tmp_);
    return FileError(error, absl::StrCat("registry: cannot ", what, " ", tmp_, " (to replace ",
                                         path_, ")"));
  };
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = files_.Write(fd, bytes.data() + done, bytes.size() - done);
    if (n <= 0) {
      files_.Close(fd);
      return fail(n < 0 ? -n : EIO, "write");
    }
    done += n;
  }
  if (const int e = files_.Fsync(fd); e < 0) {
    files_.Close(fd);
    return fail(-e, "flush (fsync)");
  }
  if (const int e = files_.Close(fd); e < 0) return fail(-e, "close");
  if (const int e = files_.Rename(tmp_, path_); e < 0) return fail(-e, "rename");
  *renamed = true;
  // The rename is durable once the directory is.
  const int dir = files_.Open(dir_, O_RDONLY | O_DIRECTORY | O_CLOEXEC, 0);
  if (dir < 0) return FileError(-dir, absl::StrCat("registry: cannot open ", dir_, " to flush ",
                                                   path_));
  const int e = files_.Fsync(dir);
  files_.Close(dir);
  if (e < 0) {
    return FileError(-e, absl::StrCat("registry: cannot flush (fsync) ", dir_, " after renaming ",
                                      path_));
  }
  return absl::OkStatus();
}

}  // namespace shardserve::server
