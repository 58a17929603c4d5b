// A rank's write-ahead log of row updates, and applying an update call to its shard.
//
// - Each applied call advances the load's update sequence (ShardedTable::seq) and, where the
//   load has an UpdateLog, appends a record of what this rank applied; so does each renorm of a
//   max_norm lookup (ShardedTable::lsn counts both). The step loop's syncer writes each log's
//   records of every waiting step with one fsync (group commit); an update is answered once
//   every rank has synced it (core/step/step_loop.cc).
// - UpdateLog: records (a checksummed header, then the payload) appended to `dir`/wal. Once the
//   log grows past its bound a fresh wal starts beside it (wal.old) and a thread writes a snapshot
//   of the shard (`dir`/snapshot.safetensors, with the position it reflects), then removes
//   wal.old. A torn tail (a crash in a write) is cut off when the log is opened, so each call is
//   in the log whole or not at all.
//
// Thread-compatible: the step loop's thread appends and snapshots, one syncer thread writes
// (TakePending hands the records over); acknowledged() and bytes() may be read from any thread.
#ifndef SHARDSERVE_CORE_TABLE_UPDATE_LOG_H_
#define SHARDSERVE_CORE_TABLE_UPDATE_LOG_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/table/sharded_table.h"
#include "core/table/table_config.h"

namespace shardserve::core {

// What an update call does to its rows; kScale is a renorm's, logged only.
enum class UpdateKind : int64_t { kAssign = 0, kAdd = 1, kScale = 2 };

// One update call as every rank applies it: views into its rank's update message
// (core/step/update_message.h).
struct UpdateCall {
  UpdateKind kind = UpdateKind::kAssign;
  int64_t k = 0;
  const int64_t* ids = nullptr;   // k
  const float* values = nullptr;  // k x num_cols
  const float* bias = nullptr;    // k, or null
  uint64_t expected_seq = 0;      // the sequence the call must get (0: whatever it is)
};

// Applies `call` to this rank's part of `table` (duplicate ids in order: ASSIGN keeps the last,
// ADD sums), logs it (pending until the log's Commit) and advances the table's sequence.
absl::Status ApplyUpdate(ShardedTable& table, const UpdateCall& call);
// Logs a renorm the lookup applied: shard rows `local_rows` scaled by `scales`.
void LogRenorm(ShardedTable& table, absl::Span<const int64_t> local_rows,
               absl::Span<const float> scales);

// An allocator that leaves new elements uninitialised: record buffers are written whole right
// after they grow (zeroing them first showed as 6 % of an update's time).
template <typename T>
struct UninitializedAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  using std::allocator<T>::allocator;
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

// Log records as appended (UpdateLog::TakePending, Write).
using LogRecords = std::vector<char, UninitializedAllocator<char>>;

class UpdateLog {
 public:
  struct Options {
    int64_t snapshot_bytes = int64_t{64} << 20;  // the log's size that triggers a snapshot
  };
  // Opens the log of a load in `dir` (created if missing) and brings `table` (freshly loaded
  // from its base) to what the directory holds: its snapshot, then every whole record after it.
  // A torn or corrupt tail is cut off. With `max_agreed`, records past that agreed position
  // (ShardedTable::agreed) are cut off too: a group whose ranks logged different tails agrees on
  // the shortest (none of it was acknowledged).
  static absl::StatusOr<std::shared_ptr<UpdateLog>> Open(const std::string& dir,
                                                          ShardedTable& table, Options options,
                                                          uint64_t max_agreed = ~uint64_t{0});
  ~UpdateLog();

  const std::string& dir() const { return dir_; }
  bool pending() const { return !pending_.empty(); }
  int64_t bytes() const { return bytes_.load(); }  // of the log file, written records only
  // The agreed position every rank of the group has durably, as far as this process knows (0 after
  // a restart: a recovered tail may hold a step's records some peer never wrote). Thread-safe.
  uint64_t acknowledged() const { return acknowledged_.load(std::memory_order_acquire); }
  void Acknowledge(uint64_t agreed) { acknowledged_.store(agreed, std::memory_order_release); }
  // The agreed position Open recovered the load to: a load still there has run no step since.
  uint64_t recovered() const { return recovered_; }
  // Open found no directory and made it: nothing was there to recover (a first load, or a disk
  // that lost the log).
  bool created() const { return created_; }

  // Appends a record of what was just applied to `table`, at its position (pending: in memory
  // until Commit).
  void Append(const ShardedTable& table, UpdateKind kind, absl::Span<const int64_t> ids,
              absl::Span<const float> values, absl::Span<const float> bias);
  // The same with `num_values` floats that `fill` writes in place.
  void Append(const ShardedTable& table, UpdateKind kind, absl::Span<const int64_t> ids,
              int64_t num_values, absl::FunctionRef<void(float*)> fill,
              absl::Span<const float> bias);
  // Writes the pending records and syncs them to disk: INTERNAL (naming the file) if it cannot,
  // and the pending records are dropped either way.
  absl::Status Commit();
  // The same in two halves, for a step loop that syncs on another thread: the pending records
  // (taken on the loop's thread), then writing and syncing them (on one other thread, in order;
  // no snapshot may start meanwhile).
  LogRecords TakePending();
  absl::Status Write(const LogRecords& records);
  // Writes several steps' records in order and syncs once (the syncer's group commit).
  absl::Status Write(absl::Span<const LogRecords* const> records);
  void Discard() { pending_.clear(); }
  // When the log has grown past its bound: copies `table`'s shard, starts a new log beside the
  // old one, and writes the snapshot on a thread of its own, which removes the old log once the
  // snapshot is durable (one at a time; the log grows meanwhile). `table` is this log's load.
  // The copy's buffer is allocated first on that thread (the call that finds the log past its
  // bound starts that, a later one copies): a shard's worth of page faults took 8-38 ms on the
  // step loop's thread, which lookups wait for, against 3-11 ms for the copy alone.
  absl::Status MaybeSnapshot(const ShardedTable& table);
  // The same now, whatever the log's size, and waits until the snapshot is written.
  absl::Status Snapshot(const ShardedTable& table);
  // Waits for the snapshot being written, if any: its outcome (OK when none).
  absl::Status WaitForSnapshot();

 private:
  UpdateLog(std::string dir, Options options, int fd);
  absl::Status StartSnapshot(const ShardedTable& table, bool wait);
  std::string dir_;
  Options options_;
  int fd_ = -1;
  std::atomic<int64_t> bytes_{0};
  // A rotation's renames are not yet durable (the next Write syncs the directory).
  std::atomic<bool> dir_unsynced_{false};
  std::thread writer_;  // the snapshot being written, or the next one's buffer being allocated
  std::atomic<bool> written_{true};  // writer_ is done
  absl::Status written_status_;  // the last snapshot's (read once the writer has joined)
  // The next snapshot's copy, allocated ahead by writer_ (or why it could not be; read once the
  // writer is done).
  absl::StatusOr<std::vector<float>> buffer_ = std::vector<float>();
  std::atomic<uint64_t> acknowledged_{0};
  uint64_t recovered_ = 0;
  bool created_ = false;
  LogRecords pending_;
};

// Removes a load's log directory (its log, snapshot, and a cut-short snapshot's temporary files):
// OK when there is none.
absl::Status RemoveUpdateLog(const std::string& dir);

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_TABLE_UPDATE_LOG_H_
