#include "core/table/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/base/status_macros.h"

namespace shardserve::core {
namespace {

// A JSON reader just large enough for safetensors headers: objects, arrays, strings, integers
// (and, in __metadata__, anything else, skipped). Its errors name the checkpoint and where in the
// header they are (`where`, kept up to date by the caller: which tensor, which field).
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& path) : text_(text), path_(path) {}

  void set_where(std::string where) { where_ = std::move(where); }
  absl::Status Error(absl::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint \"", path_,
                                                   "\": malformed safetensors header: ", what,
                                                   " at header byte ", pos_, " (", where_, ")"));
  }
  void Space() {
    while (pos_ < text_.size() && std::isspace(static_cast<unsigned char>(text_[pos_]))) ++pos_;
  }
  bool Eat(char c) {
    Space();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  bool Peek(char c) {
    Space();
    return pos_ < text_.size() && text_[pos_] == c;
  }
  absl::StatusOr<std::string> String() {
    if (!Eat('"')) return Error("expected a string");
    std::string out;
    while (pos_ < text_.size() && text_[pos_] != '"') {
      if (text_[pos_] == '\\' && pos_ + 1 < text_.size()) ++pos_;
      out.push_back(text_[pos_++]);
    }
    if (pos_ >= text_.size()) return Error("unterminated string");
    ++pos_;
    return out;
  }
  absl::StatusOr<int64_t> Integer() {
    Space();
    const size_t start = pos_;
    if (pos_ < text_.size() && text_[pos_] == '-') ++pos_;
    while (pos_ < text_.size() && std::isdigit(static_cast<unsigned char>(text_[pos_]))) ++pos_;
    int64_t value = 0;
    if (!absl::SimpleAtoi(absl::string_view(text_.data() + start, pos_ - start), &value)) {
      pos_ = start;
      return Error("expected an integer of at most 64 bits");
    }
    return value;
  }
  absl::StatusOr<std::vector<int64_t>> Integers() {
    if (!Eat('[')) return Error("expected '['");
    std::vector<int64_t> out;
    if (Eat(']')) return out;
    do {
      SHARDSERVE_ASSIGN_OR_RETURN(int64_t v, Integer());
      out.push_back(v);
    } while (Eat(','));
    if (!Eat(']')) return Error("expected ']'");
    return out;
  }
  // Skips any JSON value, nested at most kMaxDepth deep (the stack stays small whatever the file).
  absl::Status SkipValue(int depth = 0) {
    static constexpr int kMaxDepth = 64;
    if (depth > kMaxDepth) return Error("values nested too deep");
    Space();
    if (Peek('"')) return String().status();
    if (Eat('{')) {
      if (Eat('}')) return absl::OkStatus();
      do {
        SHARDSERVE_RETURN_IF_ERROR(String().status());
        if (!Eat(':')) return Error("expected ':'");
        SHARDSERVE_RETURN_IF_ERROR(SkipValue(depth + 1));
      } while (Eat(','));
      return Eat('}') ? absl::OkStatus() : Error("expected '}'");
    }
    if (Eat('[')) {
      if (Eat(']')) return absl::OkStatus();
      do {
        SHARDSERVE_RETURN_IF_ERROR(SkipValue(depth + 1));
      } while (Eat(','));
      return Eat(']') ? absl::OkStatus() : Error("expected ']'");
    }
    while (pos_ < text_.size() &&
           std::string_view(",}] \n\t").find(text_[pos_]) == std::string_view::npos)
      ++pos_;
    return absl::OkStatus();
  }

 private:
  std::string_view text_;
  const std::string& path_;
  std::string where_ = "the header object";
  size_t pos_ = 0;
};

int64_t DtypeSize(const std::string& dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
  if (dtype == "I8" || dtype == "U8" || dtype == "BOOL") return 1;
  return 0;
}

// What a path that is not a regular file names, for messages.
const char* KindOf(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a unix socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  return "a special file";
}

absl::Status NotARegularFile(absl::string_view what, const std::string& path, mode_t mode) {
  return absl::InvalidArgumentError(
      absl::StrCat(what, " \"", path, "\": is ", KindOf(mode), ", not a regular file"));
}

absl::Status OpenError(absl::string_view what, const std::string& path, int error) {
  const std::string message = absl::StrCat(what, " \"", path, "\": ", std::strerror(error));
  if (error == ENOENT || error == ENOTDIR) return absl::NotFoundError(message);
  return absl::InvalidArgumentError(message);
}

}  // namespace

absl::StatusOr<int> OpenRegularFile(const std::string& path, absl::string_view what) {
  if (path.empty() || path.front() != '/') {
    return absl::InvalidArgumentError(absl::StrCat(
        what, " \"", path,
        "\": must be an absolute path (each process would resolve a relative one against its own "
        "working directory)"));
  }
  // A path that names anything but a regular file is refused before it is opened, so that no
  // device is opened at all (opening some acts: a tape rewinds, a watchdog arms). This check is not
  // the one that counts (the path may change before the open); fstat on what was opened is.
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return OpenError(what, path, errno);
  if (!S_ISREG(st.st_mode)) return NotARegularFile(what, path, st.st_mode);
  // O_NONBLOCK: should the path have become a FIFO, the open returns at once instead of waiting
  // for a writer without bound (on a regular file it changes nothing). O_NOCTTY: a terminal never
  // becomes the process's. Symbolic links are followed (no O_NOFOLLOW): checkpoints are often
  // links (a Hugging Face cache's snapshots, Kubernetes volumes' ..data), and what they lead to
  // must be a regular file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
  if (fd < 0) return OpenError(what, path, errno);
  if (::fstat(fd, &st) != 0) {
    const int error = errno;
    ::close(fd);
    return OpenError(what, path, error);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return NotARegularFile(what, path, st.st_mode);
  }
  return fd;
}

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) munmap(map_, size_);
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  SHARDSERVE_ASSIGN_OR_RETURN(const int fd, OpenRegularFile(path, "checkpoint"));
  struct stat st;
  if (fstat(fd, &st) != 0 || st.st_size < 8) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat("checkpoint \"", path, "\": too short"));
  }
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->fd_ = fd;  // kept for Read; closed with the file
  file->size_ = static_cast<size_t>(st.st_size);
  file->map_ = mmap(nullptr, file->size_, PROT_READ, MAP_PRIVATE, fd, 0);
  const int mmap_errno = errno;
  if (file->map_ == MAP_FAILED) {
    file->map_ = nullptr;
    return absl::InternalError(
        absl::StrCat("checkpoint \"", path, "\": mmap failed: ", std::strerror(mmap_errno)));
  }
  const char* base = static_cast<const char*>(file->map_);
  uint64_t header_len = 0;
  std::memcpy(&header_len, base, 8);
  if (header_len > file->size_ - 8) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint \"", path, "\": header length ", header_len, " exceeds the file"));
  }
  const char* data = base + 8 + header_len;
  const int64_t data_size = static_cast<int64_t>(file->size_ - 8 - header_len);
  HeaderParser p(std::string_view(base + 8, header_len), path);
  if (!p.Eat('{')) return p.Error("expected '{'");
  if (!p.Eat('}')) {
    std::string previous;  // the last tensor read, to say where a name that does not parse is
    do {
      p.set_where(previous.empty() ? "the first tensor's name"
                                   : absl::StrCat("the name after tensor \"", previous, "\""));
      SHARDSERVE_ASSIGN_OR_RETURN(std::string name, p.String());
      p.set_where(absl::StrCat("tensor \"", name, "\""));
      if (!p.Eat(':')) return p.Error("expected ':'");
      previous = name;
      if (name == "__metadata__") {
        SHARDSERVE_RETURN_IF_ERROR(p.SkipValue());
        continue;
      }
      if (!p.Eat('{')) return p.Error("expected a tensor object");
      SafetensorsTensor tensor;
      std::vector<int64_t> offsets;
      do {
        p.set_where(absl::StrCat("tensor \"", name, "\", a field name"));
        SHARDSERVE_ASSIGN_OR_RETURN(std::string field, p.String());
        p.set_where(absl::StrCat("tensor \"", name, "\", field \"", field, "\""));
        if (!p.Eat(':')) return p.Error("expected ':'");
        if (field == "dtype") {
          SHARDSERVE_ASSIGN_OR_RETURN(tensor.dtype, p.String());
        } else if (field == "shape") {
          SHARDSERVE_ASSIGN_OR_RETURN(tensor.shape, p.Integers());
        } else if (field == "data_offsets") {
          SHARDSERVE_ASSIGN_OR_RETURN(offsets, p.Integers());
        } else {
          SHARDSERVE_RETURN_IF_ERROR(p.SkipValue());
        }
      } while (p.Eat(','));
      p.set_where(absl::StrCat("tensor \"", name, "\""));
      if (!p.Eat('}')) return p.Error("expected '}'");
      // Elements that could not fit the data are refused as they are counted (no overflow).
      int64_t elements = 1;
      bool fits = true;
      for (int64_t d : tensor.shape) {
        fits = fits && d >= 0 && (d == 0 || elements <= data_size / d);
        if (fits) elements *= d;
      }
      const int64_t size = DtypeSize(tensor.dtype);
      if (!fits || offsets.size() != 2 || offsets[0] < 0 || offsets[1] < offsets[0] ||
          offsets[1] > data_size || size == 0 || (offsets[1] - offsets[0]) != elements * size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "checkpoint \"", path, "\": tensor \"", name, "\" has dtype ", tensor.dtype,
            ", shape [", absl::StrJoin(tensor.shape, ","), "] and data_offsets [",
            absl::StrJoin(offsets, ","), "], which do not fit ", data_size, " data bytes"));
      }
      tensor.data = data + offsets[0];
      tensor.bytes = offsets[1] - offsets[0];
      file->tensors_[name] = tensor;
    } while (p.Eat(','));
    p.set_where("the header object");
    if (!p.Eat('}')) return p.Error("expected '}'");
  }
  return file;
}

void SafetensorsFile::Release(const char* begin, int64_t bytes) const {
  static const uintptr_t page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const uintptr_t first = (reinterpret_cast<uintptr_t>(begin) + page - 1) / page * page;
  const uintptr_t last = (reinterpret_cast<uintptr_t>(begin) + bytes) / page * page;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

absl::Status SafetensorsFile::Read(const char* begin, int64_t bytes, void* out) const {
  const int64_t offset = begin - static_cast<const char*>(map_);
  if (offset < 0 || bytes < 0 || offset + bytes > static_cast<int64_t>(size_)) {
    return absl::InternalError("checkpoint read out of the file");
  }
  char* to = static_cast<char*>(out);
  for (int64_t done = 0; done < bytes;) {
    const ssize_t n = ::pread(fd_, to + done, bytes - done, offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      return absl::InternalError(absl::StrCat("checkpoint read failed at byte ", offset + done,
                                              ": ", n < 0 ? std::strerror(errno) : "end of file"));
    }
    done += n;
  }
  return absl::OkStatus();
}

const SafetensorsTensor* SafetensorsFile::Find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

absl::Status CheckOutputPath(const std::string& path) {
  if (path.empty() || path.front() != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("path \"", path, "\": must be absolute (a path on the writer's machine)"));
  }
  struct stat st;
  if (::lstat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("path \"", path, "\": exists and is not a regular file"));
  }
  const std::string dir = path.substr(0, std::max<size_t>(path.rfind('/'), 1));
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("path \"", path, "\": directory \"", dir, "\" does not exist"));
  }
  return absl::OkStatus();
}

std::string SafetensorsHeader(const std::vector<SafetensorsEntry>& entries) {
  std::string header = "{";
  int64_t offset = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const SafetensorsEntry& e = entries[i];
    absl::StrAppend(&header, i ? "," : "", "\"", e.name, "\":{\"dtype\":\"", e.dtype,
                    "\",\"shape\":[", absl::StrJoin(e.shape, ","), "],\"data_offsets\":[", offset,
                    ",", offset + e.bytes, "]}");
    offset += e.bytes;
  }
  header += "}";
  while ((8 + header.size()) % 8 != 0) header += ' ';  // align the data
  const uint64_t len = header.size();  // little-endian, as the hosts we run on
  return std::string(reinterpret_cast<const char*>(&len), 8) + header;
}

namespace {

// Writes `bytes` at `offset` in full (0, or the errno that stopped it).
int WriteAt(int fd, const char* data, int64_t bytes, int64_t offset) {
  for (int64_t done = 0; done < bytes;) {
    const ssize_t n = ::pwrite(fd, data + done, static_cast<size_t>(bytes - done), offset + done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno;
    if (n == 0) return EIO;
    done += n;
  }
  return 0;
}

using Pieces = std::vector<std::pair<const char*, int64_t>>;

// Writes the pieces one after another from the start of the file: 0, or the errno that stopped
// it. `direct`: around the page cache (O_DIRECT, through an aligned buffer) where the file system
// allows it.
int WritePieces(int fd, const Pieces& pieces, bool direct) {
  // O_DIRECT wants the memory, the offset and the length aligned to the device's logical block:
  // 4 KiB is a multiple of every one we know; where it is not, a write answers EINVAL and the
  // rest goes through the page cache.
  constexpr int64_t kBlock = 4096, kChunk = 4 << 20;
  const int flags = ::fcntl(fd, F_GETFL);
  std::unique_ptr<char, void (*)(void*)> chunk(nullptr, std::free);
  if (direct && flags >= 0 && ::fcntl(fd, F_SETFL, flags | O_DIRECT) == 0) {
    chunk.reset(static_cast<char*>(std::aligned_alloc(kBlock, kChunk)));
    if (chunk == nullptr) ::fcntl(fd, F_SETFL, flags);
  }
  int64_t offset = 0;
  if (chunk == nullptr) {
    for (const auto& [data, bytes] : pieces) {
      if (const int error = WriteAt(fd, data, bytes, offset); error != 0) return error;
      offset += bytes;
    }
    return 0;
  }
  int64_t filled = 0;
  // The chunk's `filled` bytes, padded to a block (the file is cut to its length at the end).
  auto flush = [&]() -> int {
    const int64_t padded = (filled + kBlock - 1) / kBlock * kBlock;
    std::memset(chunk.get() + filled, 0, static_cast<size_t>(padded - filled));
    int error = WriteAt(fd, chunk.get(), padded, offset);
    if (error == EINVAL && ::fcntl(fd, F_SETFL, flags) == 0) {
      error = WriteAt(fd, chunk.get(), filled, offset);
    }
    offset += filled;
    filled = 0;
    return error;
  };
  for (const auto& [data, bytes] : pieces) {
    for (int64_t done = 0; done < bytes;) {
      const int64_t n = std::min(bytes - done, kChunk - filled);
      std::memcpy(chunk.get() + filled, data + done, static_cast<size_t>(n));
      filled += n;
      done += n;
      if (filled == kChunk) {
        if (const int error = flush(); error != 0) return error;
      }
    }
  }
  if (filled > 0) {
    if (const int error = flush(); error != 0) return error;
  }
  return ::ftruncate(fd, offset) == 0 ? 0 : errno;
}

}  // namespace

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<SafetensorsEntry>& entries, bool durable) {
  SHARDSERVE_RETURN_IF_ERROR(CheckOutputPath(path));
  const std::string header = SafetensorsHeader(entries);
  Pieces pieces = {{header.data(), static_cast<int64_t>(header.size())}};
  for (const SafetensorsEntry& e : entries) {
    pieces.emplace_back(static_cast<const char*>(e.data), e.bytes);
  }
  // Written beside the target and renamed over it: readers never see a partial file, and a failed
  // write leaves nothing behind. The temporary file is always a new one (O_EXCL, after removing
  // what a crashed export may have left under its name): were it opened as found, a FIFO put there
  // would block the export and then be renamed over the target.
  static std::atomic<uint64_t> exports{0};
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid(), ".", exports++);
  ::unlink(tmp.c_str());
  const int fd =
      ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (fd < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("path \"", path, "\": cannot create \"", tmp, "\": ", std::strerror(errno)));
  }
  // A durable file (a worker's snapshot) is read again only after a restart: it goes around the
  // page cache. Copying a 25 MB shard into it took 160-230 ms of CPU beside updates on our VM
  // (fresh pages: freed memory goes back to the host) against ~2 ms direct, and it pushed out
  // pages the service reads.
  int error = WritePieces(fd, pieces, /*direct=*/durable);
  if (durable && error == 0 && ::fsync(fd) != 0) error = errno;
  if (::close(fd) != 0 && error == 0) error = errno;
  if (error == 0 && ::rename(tmp.c_str(), path.c_str()) != 0) error = errno;
  if (error != 0) {
    ::unlink(tmp.c_str());
    const std::string message =
        absl::StrCat("path \"", path, "\": cannot write it: ", std::strerror(error));
    return error == ENOSPC || error == EDQUOT ? absl::ResourceExhaustedError(message)
                                              : absl::InternalError(message);
  }
  return absl::OkStatus();
}

}  // namespace shardserve::core
