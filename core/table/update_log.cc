#include "core/table/update_log.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/base/host_memory.h"
#include "core/base/process_setup.h"
#include "core/base/status_macros.h"
#include "core/table/safetensors.h"

namespace shardserve::core {
namespace {

int64_t Packed(int64_t floats) { return (floats + 1) / 2; }

// A log record: kRecordMagic, the payload's bytes, its checksum (Checksum), then the payload - lsn, seq,
// agreed (the load's position after it), kind, k, values, bias (seven words), the ids (k words),
// the values and the bias as floats, padded to whole words.
constexpr uint64_t kRecordMagic = 0x31304c4157535353;  // "SSSWAL01"
constexpr int64_t kRecordHeaderBytes = 24;
constexpr int64_t kPayloadHeaderWords = 7;

// A record's checksum: a multiply-xorshift hash of its payload's words (payloads are whole words).
// Not cryptographic: it finds a torn or corrupt tail, at memory speed (a byte-wise hash took a
// quarter of an update's time).
uint64_t Checksum(const char* data, int64_t bytes) {
  uint64_t h = 0x9e3779b97f4a7c15 ^ static_cast<uint64_t>(bytes);
  for (int64_t i = 0; i + 8 <= bytes; i += 8) {
    uint64_t w;
    std::memcpy(&w, data + i, 8);
    h = (h ^ w) * 0xff51afd7ed558ccd;
    h ^= h >> 29;
  }
  return h;
}

absl::Status Errno(absl::string_view what, const std::string& path) {
  const int error = errno;
  const std::string message =
      absl::StrCat("update log: cannot ", what, " \"", path, "\": ", std::strerror(error));
  return error == ENOSPC || error == EDQUOT ? absl::ResourceExhaustedError(message)
                                            : absl::InternalError(message);
}

absl::Status MakeDirs(const std::string& dir) {
  for (size_t at = 1; at <= dir.size(); ++at) {
    if (at != dir.size() && dir[at] != '/') continue;
    const std::string prefix = dir.substr(0, at);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return Errno("create the directory", prefix);
    }
  }
  return absl::OkStatus();
}

absl::Status SyncDir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return Errno("open the directory", dir);
  const int synced = ::fsync(fd);
  ::close(fd);
  return synced == 0 ? absl::OkStatus() : Errno("sync the directory", dir);
}

// The shard row `id` is in on this rank, or -1 where another rank holds it (row-wise).
int64_t LocalRow(const ShardedTable& table, int64_t id) {
  if (table.config().spec.dim() == 1) return id;
  const int64_t local = id - table.row_begin();
  return local >= 0 && local < table.shard().rows ? local : -1;
}

// Applies a call's rows: values[i] are the row's floats from column `values_col` on, with `stride`
// floats from one row to the next (full rows from a message), or - `packed` - only the rows this
// rank holds, shard_cols each (from the log).
absl::Status ApplyRows(ShardedTable& table, UpdateKind kind, const int64_t* ids, int64_t k,
                       const float* values, int64_t stride, bool packed, const float* bias) {
  const bool add = kind == UpdateKind::kAdd;
  const int64_t cols = table.shard().cols;
  float* const host = table.HostRows();
  // (local row, its values) of each row this rank holds, in call order.
  std::vector<std::pair<int64_t, const float*>> rows;
  rows.reserve(k);
  const float* next = values;
  for (int64_t i = 0; i < k; ++i) {
    const int64_t local = LocalRow(table, ids[i]);
    if (local < 0) continue;
    rows.emplace_back(local, packed ? next : values + i * stride);
    next += cols;
  }
  if (host == nullptr) {
    for (const auto& [local, row] : rows) {
      SHARDSERVE_RETURN_IF_ERROR(table.WriteRow(local, add, row));
    }
  } else {
    // Random rows each miss the cache and the TLB, and prefetches alone overlap few of those
    // misses: in the order the rows lie in memory they overlap (512 rows of 64 floats, caches
    // cold: 61 us against 162 us in call order). Ties stay in call order (a row's values lie
    // further on the later it comes), so duplicate rows add up as they would in call order.
    std::sort(rows.begin(), rows.end());
    constexpr size_t kAhead = 8;
    const size_t n = rows.size();
    for (size_t j = 0; j < n; ++j) {
      if (j + kAhead < n) {
        const float* ahead = host + rows[j + kAhead].first * cols;
        for (int64_t c = 0; c < cols; c += 16) __builtin_prefetch(ahead + c, 1);
      }
      float* dst = host + rows[j].first * cols;
      const float* row = rows[j].second;
      if (add) {
        for (int64_t c = 0; c < cols; ++c) dst[c] += row[c];
      } else {
        std::memcpy(dst, row, cols * sizeof(float));
      }
    }
  }
  if (bias != nullptr) {
    std::vector<float>& b = table.mutable_bias();
    for (int64_t i = 0; i < k; ++i) {
      b[ids[i]] = add ? b[ids[i]] + bias[i] : bias[i];
    }
  }
  return absl::OkStatus();
}

std::string SnapshotPath(const std::string& dir) { return dir + "/snapshot.safetensors"; }
std::string LogPath(const std::string& dir) { return dir + "/wal"; }
// The log a snapshot is being written from (the current one starts empty beside it).
std::string OldLogPath(const std::string& dir) { return dir + "/wal.old"; }

// Brings `table` to `dir`'s snapshot, if it has one.
absl::Status ReadSnapshot(const std::string& dir, ShardedTable& table) {
  const std::string path = SnapshotPath(dir);
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return absl::OkStatus();
  SHARDSERVE_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> file, SafetensorsFile::Open(path));
  const SafetensorsTensor* shard = file->Find("shard");
  const SafetensorsTensor* position = file->Find("position");
  const MatrixView view = table.shard();
  if (shard == nullptr || shard->dtype != "F32" || position == nullptr ||
      position->dtype != "I64" || position->bytes != 24 ||
      shard->bytes != view.rows * view.cols * static_cast<int64_t>(sizeof(float))) {
    return absl::DataLossError(absl::StrCat("update log: snapshot \"", path,
                                            "\" does not hold this rank's shard of ",
                                            view.rows, " x ", view.cols, " floats"));
  }
  std::vector<float> rows(view.rows * view.cols);
  SHARDSERVE_RETURN_IF_ERROR(file->Read(shard->data, shard->bytes, rows.data()));
  SHARDSERVE_RETURN_IF_ERROR(table.LoadShard(rows.data()));
  if (const SafetensorsTensor* bias = file->Find("bias"); bias != nullptr) {
    std::vector<float>& b = table.mutable_bias();
    if (bias->bytes != static_cast<int64_t>(b.size() * sizeof(float))) {
      return absl::DataLossError(absl::StrCat("update log: snapshot \"", path,
                                              "\" holds a bias of another size"));
    }
    SHARDSERVE_RETURN_IF_ERROR(file->Read(bias->data, bias->bytes, b.data()));
  }
  int64_t at[3];
  SHARDSERVE_RETURN_IF_ERROR(file->Read(position->data, 24, at));
  table.SetPosition(static_cast<uint64_t>(at[0]), static_cast<uint64_t>(at[1]),
                    static_cast<uint64_t>(at[2]));
  return absl::OkStatus();
}

// Replays the whole records of the log file `fd` (`path`) that follow `table`'s position, up to
// `max_agreed`, and cuts the file after the last one kept (a torn or corrupt tail, or records
// past max_agreed: never acknowledged), setting `cut`. Returns the bytes kept.
absl::StatusOr<int64_t> Replay(int fd, const std::string& path, ShardedTable& table,
                               uint64_t max_agreed, bool* cut) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return Errno("read", path);
  std::vector<char> data(static_cast<size_t>(st.st_size));
  for (int64_t done = 0; done < st.st_size;) {
    const ssize_t n = ::pread(fd, data.data() + done, st.st_size - done, done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return Errno("read", path);
    done += n;
  }
  const MatrixView shard = table.shard();
  int64_t good = 0;  // bytes of whole records kept
  const int64_t size = st.st_size;
  while (size - good >= kRecordHeaderBytes) {
    uint64_t head[3];
    std::memcpy(head, data.data() + good, sizeof(head));
    const int64_t bytes = static_cast<int64_t>(head[1]);
    if (head[0] != kRecordMagic || bytes < kPayloadHeaderWords * 8 ||
        bytes > size - good - kRecordHeaderBytes) {
      break;
    }
    const char* payload = data.data() + good + kRecordHeaderBytes;
    if (Checksum(payload, bytes) != head[2]) break;
    std::vector<int64_t> words(bytes / 8);
    std::memcpy(words.data(), payload, words.size() * 8);
    const uint64_t lsn = words[0], seq = words[1], agreed = words[2];
    const auto kind = static_cast<UpdateKind>(words[3]);
    const int64_t k = words[4], num_values = words[5], num_bias = words[6];
    const int64_t need = kPayloadHeaderWords + k + Packed(num_values) + Packed(num_bias);
    if (k < 0 || num_values < 0 || num_bias < 0 || need * 8 != bytes) break;
    if (agreed > max_agreed) break;
    const int64_t* ids = words.data() + kPayloadHeaderWords;
    const auto* values = reinterpret_cast<const float*>(ids + k);
    const auto* bias = reinterpret_cast<const float*>(ids + k + Packed(num_values));
    if (lsn <= table.lsn()) {  // in the snapshot already
      good += kRecordHeaderBytes + bytes;
      continue;
    }
    if (lsn != table.lsn() + 1) {
      return absl::DataLossError(absl::StrCat("update log \"", path, "\": record ", lsn,
                                              " follows record ", table.lsn()));
    }
    bool fits = true;
    for (int64_t i = 0; i < k && fits; ++i) {
      fits = kind == UpdateKind::kScale ? ids[i] >= 0 && ids[i] < shard.rows
                                        : ids[i] >= 0 && ids[i] < table.config().num_rows;
    }
    if (!fits || (kind == UpdateKind::kScale && num_values != k) ||
        (num_bias != 0 && (num_bias != k || table.bias().empty()))) {
      return absl::DataLossError(
          absl::StrCat("update log \"", path, "\": record ", lsn, " does not fit this shard"));
    }
    if (kind == UpdateKind::kScale) {
      // The kernel the renorm ran, so the bytes come out the same.
      SHARDSERVE_RETURN_IF_ERROR(table.ScaleRows(ids, k, values));
    } else {
      int64_t owned = 0;
      for (int64_t i = 0; i < k; ++i) owned += LocalRow(table, ids[i]) >= 0 ? 1 : 0;
      if (owned * shard.cols != num_values) {
        return absl::DataLossError(absl::StrCat("update log \"", path, "\": record ", lsn,
                                                " holds rows of another shard"));
      }
      SHARDSERVE_RETURN_IF_ERROR(ApplyRows(table, kind, ids, k, values, shard.cols, true,
                                           num_bias ? bias : nullptr));
    }
    table.SetPosition(lsn, seq, agreed);
    good += kRecordHeaderBytes + bytes;
  }
  if (good != size) {  // a torn or corrupt tail, or records past max_agreed: never acknowledged
    if (::ftruncate(fd, good) != 0 || ::fsync(fd) != 0) return Errno("cut the tail of", path);
    *cut = true;
  }
  return good;
}

}  // namespace

absl::Status ApplyUpdate(ShardedTable& table, const UpdateCall& call) {
  const int64_t cols = table.config().num_cols;
  const int64_t shard_cols = table.shard().cols;
  SHARDSERVE_RETURN_IF_ERROR(ApplyRows(table, call.kind, call.ids, call.k,
                                       call.values + table.col_begin(), cols, false, call.bias));
  table.SetPosition(table.lsn() + 1, table.seq() + 1, table.agreed() + 1);
  if (UpdateLog* log = table.log(); log != nullptr) {
    // This rank's part of the rows is what it logs, copied straight into the record.
    int64_t owned = 0;
    for (int64_t i = 0; i < call.k; ++i) owned += LocalRow(table, call.ids[i]) >= 0 ? 1 : 0;
    log->Append(
        table, call.kind, absl::MakeConstSpan(call.ids, call.k), owned * shard_cols,
        [&](float* out) {
          for (int64_t i = 0; i < call.k; ++i) {
            if (LocalRow(table, call.ids[i]) < 0) continue;
            const float* row = call.values + i * cols + table.col_begin();
            std::memcpy(out, row, shard_cols * sizeof(float));
            out += shard_cols;
          }
        },
        call.bias ? absl::MakeConstSpan(call.bias, call.k) : absl::Span<const float>());
  }
  return absl::OkStatus();
}

void LogRenorm(ShardedTable& table, absl::Span<const int64_t> local_rows,
               absl::Span<const float> scales) {
  UpdateLog* log = table.log();
  if (log == nullptr || local_rows.empty()) return;
  const bool alike = table.config().spec.dim() == 1;  // every rank renorms the same rows
  table.SetPosition(table.lsn() + 1, table.seq(), table.agreed() + (alike ? 1 : 0));
  log->Append(table, UpdateKind::kScale, local_rows, scales, {});
}

UpdateLog::UpdateLog(std::string dir, Options options, int fd)
    : dir_(std::move(dir)), options_(options), fd_(fd) {}

UpdateLog::~UpdateLog() {
  if (writer_.joinable()) writer_.join();
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<std::shared_ptr<UpdateLog>> UpdateLog::Open(const std::string& dir,
                                                            ShardedTable& table, Options options,
                                                            uint64_t max_agreed) {
  struct stat st;
  const bool created = ::stat(dir.c_str(), &st) != 0 && errno == ENOENT;
  SHARDSERVE_RETURN_IF_ERROR(MakeDirs(dir));
  SHARDSERVE_RETURN_IF_ERROR(ReadSnapshot(dir, table));
  const std::string path = LogPath(dir);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) return Errno("open", path);
  std::shared_ptr<UpdateLog> log(new UpdateLog(dir, options, fd));
  SHARDSERVE_RETURN_IF_ERROR(SyncDir(dir));  // the log's name is durable before any record

  // The log a snapshot was being written from, if its writing did not finish (a snapshot bounds
  // both), then the current one: every whole record after the snapshot.
  bool cut = false;
  const std::string old_path = OldLogPath(dir);
  if (const int old_fd = ::open(old_path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW); old_fd >= 0) {
    const absl::StatusOr<int64_t> kept = Replay(old_fd, old_path, table, max_agreed, &cut);
    ::close(old_fd);
    if (!kept.ok()) return kept.status();
  } else if (errno != ENOENT) {
    return Errno("open", old_path);
  }
  int64_t good = 0;
  if (cut) {  // what follows a cut is never acknowledged either
    if (::ftruncate(fd, 0) != 0 || ::fsync(fd) != 0) return Errno("cut", path);
  } else {
    SHARDSERVE_ASSIGN_OR_RETURN(good, Replay(fd, path, table, max_agreed, &cut));
  }
  log->bytes_ = good;
  log->recovered_ = table.agreed();
  log->created_ = created;
  return log;
}

void UpdateLog::Append(const ShardedTable& table, UpdateKind kind, absl::Span<const int64_t> ids,
                       absl::Span<const float> values, absl::Span<const float> bias) {
  Append(table, kind, ids, static_cast<int64_t>(values.size()),
         [&](float* out) { std::memcpy(out, values.data(), values.size() * sizeof(float)); },
         bias);
}

void UpdateLog::Append(const ShardedTable& table, UpdateKind kind, absl::Span<const int64_t> ids,
                       int64_t nv, absl::FunctionRef<void(float*)> fill,
                       absl::Span<const float> bias) {
  const int64_t k = static_cast<int64_t>(ids.size());
  const int64_t nb = static_cast<int64_t>(bias.size());
  const int64_t words = kPayloadHeaderWords + k + Packed(nv) + Packed(nb);
  const size_t at = pending_.size();
  pending_.resize(at + kRecordHeaderBytes + words * 8);  // every byte is written below
  char* payload = pending_.data() + at + kRecordHeaderBytes;
  const int64_t header[kPayloadHeaderWords] = {static_cast<int64_t>(table.lsn()),
                                               static_cast<int64_t>(table.seq()),
                                               static_cast<int64_t>(table.agreed()),
                                               static_cast<int64_t>(kind),
                                               k,
                                               nv,
                                               nb};
  std::memcpy(payload, header, sizeof(header));
  std::memcpy(payload + sizeof(header), ids.data(), k * 8);
  char* const values_at = payload + sizeof(header) + k * 8;
  fill(reinterpret_cast<float*>(values_at));
  char* const bias_at = values_at + Packed(nv) * 8;
  std::memcpy(bias_at, bias.data(), nb * sizeof(float));
  // The padding of an odd count of floats, zeroed: the file holds nothing but the record.
  if (nv % 2 != 0) std::memset(values_at + nv * sizeof(float), 0, sizeof(float));
  if (nb % 2 != 0) std::memset(bias_at + nb * sizeof(float), 0, sizeof(float));
  const uint64_t head[3] = {kRecordMagic, static_cast<uint64_t>(words * 8),
                            Checksum(payload, words * 8)};
  std::memcpy(pending_.data() + at, head, sizeof(head));
}

absl::Status UpdateLog::Commit() {
  const absl::Status written = Write(pending_);
  pending_.clear();  // keeps its capacity for the next step's records
  return written;
}

LogRecords UpdateLog::TakePending() {
  LogRecords records;
  records.swap(pending_);
  // The next step's records likely take as much: growing a LogRecords moves its bytes one by one
  // (its allocator is not std::allocator), 4 % of a worker's time under 512-row updates.
  pending_.reserve(records.capacity());
  return records;
}

absl::Status UpdateLog::Write(const LogRecords& records) {
  const LogRecords* one = &records;
  return Write(absl::MakeConstSpan(&one, 1));
}

absl::Status UpdateLog::Write(absl::Span<const LogRecords* const> records) {
  int64_t at = bytes_.load();
  for (const LogRecords* r : records) {
    const int64_t total = static_cast<int64_t>(r->size());
    for (int64_t done = 0; done < total;) {
      const ssize_t n = ::pwrite(fd_, r->data() + done, total - done, at + done);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return Errno("append to", LogPath(dir_));
      done += n;
    }
    at += total;
  }
  if (at == bytes_.load()) return absl::OkStatus();
  if (::fdatasync(fd_) != 0) return Errno("sync", LogPath(dir_));
  if (dir_unsynced_) {
    SHARDSERVE_RETURN_IF_ERROR(SyncDir(dir_));
    dir_unsynced_ = false;
  }
  bytes_ = at;
  return absl::OkStatus();
}

absl::Status UpdateLog::MaybeSnapshot(const ShardedTable& table) {
  if (bytes_ < options_.snapshot_bytes) return absl::OkStatus();
  if (writer_.joinable() && !written_.load(std::memory_order_acquire)) {
    return absl::OkStatus();  // one snapshot at a time: the log grows until it is written
  }
  const int64_t floats = table.shard().rows * table.shard().cols;
  if (floats == 0 || (buffer_.ok() && !buffer_->empty())) {
    return StartSnapshot(table, /*wait=*/false);  // an empty shard needs no buffer
  }
  if (writer_.joinable()) writer_.join();
  if (!written_status_.ok()) return written_status_;
  if (!buffer_.ok()) {
    return std::exchange(buffer_, std::vector<float>()).status();  // tried again at the next call
  }
  written_.store(false, std::memory_order_release);
  writer_ = std::thread([this, floats] {
    NameThread("snapshot");
    buffer_ = HostFloats(floats, "a copy of the shard");
    written_.store(true, std::memory_order_release);
  });
  return absl::OkStatus();
}

absl::Status UpdateLog::Snapshot(const ShardedTable& table) {
  return StartSnapshot(table, /*wait=*/true);
}

absl::Status UpdateLog::WaitForSnapshot() {
  if (writer_.joinable()) writer_.join();
  return written_status_;
}

absl::Status UpdateLog::StartSnapshot(const ShardedTable& table, bool wait) {
  if (writer_.joinable()) writer_.join();
  // A snapshot that could not be written left the log it was taken from: no more rotations
  // (the log grows) until a restart replays both.
  if (!written_status_.ok()) return written_status_;
  if (!pending_.empty()) return absl::FailedPreconditionError("update log: records not committed");
  // The shard as of now, copied on this (the step loop's) thread; written on another, so that a
  // step waits for the copy only, not for the disk.
  std::vector<float> shard;
  if (buffer_.ok()) shard = std::exchange(*buffer_, {});
  if (!shard.empty()) {
    SHARDSERVE_RETURN_IF_ERROR(table.ReadShard(absl::MakeSpan(shard)));
  } else {
    SHARDSERVE_ASSIGN_OR_RETURN(shard, table.ReadShard());
  }
  std::vector<float> bias = table.bias();
  const MatrixView view = table.shard();
  std::vector<int64_t> position = {static_cast<int64_t>(table.lsn()),
                                   static_cast<int64_t>(table.seq()),
                                   static_cast<int64_t>(table.agreed())};
  // The records so far move to wal.old; new ones go to a fresh log beside it.
  const std::string path = LogPath(dir_), old_path = OldLogPath(dir_);
  if (::rename(path.c_str(), old_path.c_str()) != 0) return Errno("rotate", path);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
  if (fd < 0) return Errno("open", path);
  ::close(fd_);
  fd_ = fd;
  bytes_ = 0;
  // The new names are made durable by the next Write, before any record of the new log counts as
  // written: a directory's fsync took 7-8 ms here, on the thread lookups wait for.
  dir_unsynced_ = true;
  written_.store(false, std::memory_order_release);
  writer_ = std::thread([this, shard = std::move(shard), bias = std::move(bias), view,
                         position = std::move(position)] {
    NameThread("snapshot");
    std::vector<SafetensorsEntry> entries = {
        {"shard", "F32", {view.rows, view.cols}, shard.data(),
         static_cast<int64_t>(shard.size() * sizeof(float))},
        {"position", "I64", {3}, position.data(), 24}};
    if (!bias.empty()) {
      entries.push_back({"bias", "F32", {static_cast<int64_t>(bias.size())}, bias.data(),
                         static_cast<int64_t>(bias.size() * sizeof(float))});
    }
    // The snapshot is durable before the old log goes: a crash in between replays nothing twice,
    // as records up to the snapshot's position are skipped.
    absl::Status status = WriteSafetensors(SnapshotPath(dir_), entries, /*durable=*/true);
    if (status.ok()) status = SyncDir(dir_);
    if (status.ok() && ::unlink(OldLogPath(dir_).c_str()) != 0) {
      status = Errno("remove", OldLogPath(dir_));
    }
    if (status.ok()) status = SyncDir(dir_);
    written_status_ = status;
    written_.store(true, std::memory_order_release);
  });
  if (!wait) return absl::OkStatus();
  writer_.join();
  return written_status_;
}

absl::Status RemoveUpdateLog(const std::string& dir) {
  std::vector<std::string> paths = {LogPath(dir), OldLogPath(dir), SnapshotPath(dir)};
  // And what a snapshot that a crash cut short left (WriteSafetensors' temporary files).
  const std::string tmp = "snapshot.safetensors.tmp.";
  if (DIR* d = ::opendir(dir.c_str()); d != nullptr) {
    while (const dirent* e = ::readdir(d)) {
      if (std::strncmp(e->d_name, tmp.data(), tmp.size()) == 0) {
        paths.push_back(absl::StrCat(dir, "/", e->d_name));
      }
    }
    ::closedir(d);
  }
  for (const std::string& path : paths) {
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) return Errno("remove", path);
  }
  if (::rmdir(dir.c_str()) != 0 && errno != ENOENT) return Errno("remove", dir);
  return absl::OkStatus();
}

}  // namespace shardserve::core
