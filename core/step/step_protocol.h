// The step protocol: what the ranks of a group say to each other in a step's agreement round,
// and how they read it back. Pure functions and value types, unit-tested on their own
// (step_protocol_test.cc); the step loop (step_loop.h) runs them.
//
// - A group's first round is a hello: every rank says which step protocol it speaks and how it
//   forms steps, so that ranks of different builds or settings fail the group with an error that
//   says so instead of misreading each other's rounds.
// - Every later round is an agreement: each rank sends the digest of the tables it holds, then for
//   each (table, op) key it has work for, the key and its input message (input_message.h) - the
//   concatenated input of its queued requests for that key. Every rank thus learns every rank's
//   work and input, and the ops need no input round of their own.
// - In the rare step whose ranks hold different tables (digests differ: a table being created,
//   replaced or dropped, a version staged, switched to or unloaded), one more round tells them
//   which tables each holds, and work for a table not every rank holds alike is answered
//   UNAVAILABLE on every rank.
// - Versions: work names a version (pinned) or none (the latest). The latest is the highest
//   version that some rank has been told to serve (its active one) and that every rank holds: so
//   a group switches to a new version at one step, the first whose round shows it active on any
//   rank once every rank holds it, and no step mixes two versions. A version staged on every rank
//   and active on none cannot be pinned yet; staged versions stay out of the digest, so ranks
//   that load one at different speeds need no extra round meanwhile.
// - Updates (op kUpdate, row_updates.h) are work like any other: their key names the table, their
//   message every call of the rank whole, and every rank applies every rank's calls in order. Each
//   agreement also says up to which round the rank's update logs are synced: an update is
//   answered once every rank's are synced past the round that applied it.
//
// Bump kStepProtocol on any change to these messages, the input message or the ops' collectives.
#ifndef SHARDSERVE_CORE_STEP_STEP_PROTOCOL_H_
#define SHARDSERVE_CORE_STEP_STEP_PROTOCOL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/ops/input_message.h"
#include "core/step/step_request.h"
#include "core/step/table_source.h"

namespace shardserve::core {

inline constexpr int64_t kStepProtocol = 8;

// Requests that can share one sharded op call: same table, op, pool mode and weights-or-not.
struct WorkKey {
  StepRequest::Op op = StepRequest::Op::kEmbedding;
  PoolMode mode = PoolMode::kSum;
  bool has_weights = false;
  std::string table;
  uint64_t version = 0;  // pinned, or 0: the latest

  static WorkKey Of(const StepRequest& request);
  InputKind kind() const;
  bool operator<(const WorkKey& other) const;
  bool operator==(const WorkKey& other) const;
};

// This rank's hello, and the check of every rank's: FAILED_PRECONDITION naming the rank that
// speaks another protocol or forms steps otherwise (--one_request_per_step).
std::vector<int64_t> HelloMessage(bool one_request_per_step);
absl::Status CheckHellos(absl::Span<const absl::Span<const char>> hellos,
                         bool one_request_per_step);

// Builds this rank's agreement message.
class AgreementWriter {
 public:
  // `synced`: every update log record this rank wrote in rounds up to this one (of the group's
  // rounds, counted from its first) is on its disk; -1: a log could not be synced.
  explicit AgreementWriter(uint64_t digest, int64_t synced = 0);
  // Adds `key`'s work: the concatenated input of `requests` (all of `key`, validated against
  // `table` when they were prepared).
  void Add(const WorkKey& key, absl::Span<StepRequest* const> requests);
  absl::Span<const char> bytes() const;

 private:
  // A lookup's input message (input_message.h), after its entry header at `entry`.
  void AddInput(const WorkKey& key, absl::Span<StepRequest* const> requests, size_t entry,
                size_t at);
  std::vector<int64_t> words_;
};

// Every rank's agreement message, read back (the same on every rank). The inputs are views into
// the messages, or into copies of them after Own().
class Agreement {
 public:
  // INTERNAL for a message that does not hold what it says.
  static absl::StatusOr<Agreement> Read(absl::Span<const absl::Span<const char>> messages);

  int world() const { return static_cast<int>(has_work_.size()); }
  bool same_tables() const { return same_tables_; }  // every rank sent the same digest
  // What each rank said of its update logs (AgreementWriter's `synced`).
  const std::vector<int64_t>& synced() const { return synced_; }
  bool has_work(int rank) const { return has_work_[rank]; }
  // Per key, each rank's input message for it; a rank without work for it has an empty span
  // (data() == nullptr).
  std::map<WorkKey, std::vector<absl::Span<const char>>>& work() { return work_; }

  // Copies the messages out of the channel's buffers, which its next round reuses.
  void Own();

 private:
  std::vector<absl::Span<const char>> messages_;
  std::vector<std::vector<int64_t>> owned_;
  std::vector<bool> has_work_;
  std::vector<int64_t> synced_;
  bool same_tables_ = true;
  std::map<WorkKey, std::vector<absl::Span<const char>>> work_;
};

// The tables this rank holds (name, versions and their identities, the active version), for a
// step whose ranks hold different ones.
std::vector<int64_t> HeldTablesMessage(const TableSet& tables);

// What the group holds of one table, from every rank's HeldTablesMessage.
struct HeldAlike {
  std::set<uint64_t> versions;  // held alike (same identity) by every rank
  std::set<uint64_t> active;    // active (and held) on some rank
  // The version work for `version` (0: the latest) runs on; none when the group cannot run it.
  std::optional<uint64_t> Resolve(uint64_t version) const;
};
absl::StatusOr<std::map<std::string, HeldAlike>> TablesHeldAlike(
    absl::Span<const absl::Span<const char>> messages);

// Views of int64 words as the bytes a channel sends.
inline absl::Span<const char> AsBytes(const std::vector<int64_t>& words) {
  return absl::Span<const char>(reinterpret_cast<const char*>(words.data()),
                                words.size() * sizeof(int64_t));
}

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_STEP_STEP_PROTOCOL_H_
