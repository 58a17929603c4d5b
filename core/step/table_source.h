// The tables a rank holds, as the step loop sees them: an immutable TableSet snapshot that a step
// holds for its whole duration (TF Serving's ServableHandle idea), and TableSource, where the loop
// gets the latest one from. The worker's table lifecycle (server/worker/table_lifecycle.h) is the
// TableSource of a serving process; tests use FixedTables.
//
// A table may be held in several versions (TableConfig::version): the one calls that name no
// version get on this rank (`active`), a next one staged beside it, and older ones kept for calls
// pinned to them. Which version a step runs is decided by the group (step_protocol.h), never by
// one rank alone.
#ifndef SHARDSERVE_CORE_STEP_TABLE_SOURCE_H_
#define SHARDSERVE_CORE_STEP_TABLE_SOURCE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/table/sharded_table.h"
#include "core/table/table_config.h"

namespace shardserve::core {

// What ranks must agree on to run a table's ops together: its name and its whole config
// (including where its weights came from). The same in every process.
int64_t TableIdentity(const TableConfig& config);

struct TableSet {
  // A table's loads. Those newer than the active version are staged: being switched to, not yet
  // served.
  struct Versions {
    std::map<uint64_t, std::shared_ptr<ShardedTable>> loads;  // by TableConfig::version
    uint64_t active = 0;  // what calls that name no version get on this rank (0: none)
  };
  std::map<std::string, Versions> tables;
  // Of every table's active version and the identities of its loads up to it (staged ones left
  // out, so that ranks loading a version at different speeds keep equal digests): equal on ranks
  // that serve the same tables alike.
  uint64_t digest = 0;

  static std::shared_ptr<const TableSet> Of(std::map<std::string, Versions> tables);
  // The load of `name` that `version` names here (0: the active one; a staged one is not found),
  // or null: the same on ranks with equal digests.
  std::shared_ptr<ShardedTable> Find(const std::string& name, uint64_t version) const;
  // The load of exactly `version` (staged too), or null: for a version the group agreed on.
  std::shared_ptr<ShardedTable> Load(const std::string& name, uint64_t version) const;
};

class TableSource {
 public:
  virtual ~TableSource() = default;
  // The tables this rank holds now. Thread-safe.
  virtual std::shared_ptr<const TableSet> Tables() const = 0;
  // A step failed in the middle of a lookup that renorms `table`'s rows in place (a
  // column-sharded max_norm table): its rows may now differ from the peers'. The source stops
  // offering it (unless it holds another load of the table by now) until it is loaded again on
  // every rank. Called on the step loop's thread.
  virtual void DropRenormUnsure(const std::shared_ptr<ShardedTable>& table) = 0;
};

// A TableSource that holds what it is given: for tests, benchmarks and embedders that manage
// tables themselves. Thread-safe.
class FixedTables : public TableSource {
 public:
  FixedTables();
  // Holds `table` as its name's only version, active.
  void Set(std::shared_ptr<ShardedTable> table);
  // Holds `table` beside the name's other versions (replacing its own version), not active.
  void Stage(std::shared_ptr<ShardedTable> table);
  // Calls that name no version get `version` of `name` from now on.
  void Activate(const std::string& name, uint64_t version);
  void Drop(const std::string& name);                     // every version
  void Drop(const std::string& name, uint64_t version);   // that version

  std::shared_ptr<const TableSet> Tables() const override;
  void DropRenormUnsure(const std::shared_ptr<ShardedTable>& table) override;

 private:
  mutable absl::Mutex mu_;
  std::shared_ptr<const TableSet> tables_ ABSL_GUARDED_BY(mu_);
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_STEP_TABLE_SOURCE_H_
