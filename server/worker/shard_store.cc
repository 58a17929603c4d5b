#include "server/worker/shard_store.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "core/base/host_memory.h"
#include "core/base/status_macros.h"
#include "core/table/update_log.h"
#include "glog/logging.h"
#include "server/common/table_spec.h"

namespace shardserve::server {

core::HostMemoryRoom ShardStore::Room() const {
  core::HostMemoryRoom room;
  if (options_.table_memory_bytes > 0) {
    room.bytes = std::max<int64_t>(options_.table_memory_bytes - tables_.HeldBytes(), 0);
    room.limit = absl::StrCat("--table_memory_mb ", options_.table_memory_bytes >> 20);
  }
  if (options_.host_memory) {
    core::HostMemoryRoom host = core::AvailableHostMemory();
    if (host.bytes >= 0 && (room.bytes < 0 || host.bytes < room.bytes)) room = std::move(host);
  }
  return room;
}

int64_t ShardStore::MemoryAvailable() const { return Room().bytes; }

absl::StatusOr<std::shared_ptr<core::ShardedTable>> ShardStore::Load(const v1::TableSpec& spec,
                                                                     int world,
                                                                     uint64_t max_agreed) {
  SHARDSERVE_ASSIGN_OR_RETURN(core::TableConfig config, ConfigFromSpec(spec, world));
  if (!options_.fail_load.empty() && spec.name() == options_.fail_load && spec.version() > 1) {
    return absl::InternalError(absl::StrCat("--fail_load drill: version ", spec.version(),
                                            " of table \"", spec.name(), "\" not loaded"));
  }
  const int64_t need = config.ShardBytes(options_.rank);
  const core::HostMemoryRoom room = Room();
  if (room.bytes >= 0 && need > room.bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "version ", spec.version(), " of table \"", spec.name(), "\" needs ", need,
        " bytes for its shard, but only ", room.bytes, " are available under ", room.limit,
        " (tables held: ", tables_.HeldBytes(), " bytes)"));
  }
  // At most load_bytes_per_s while the worker holds tables it serves (a worker that holds none,
  // just started, loads at full speed): after each chunk, wait until the bytes so far are due.
  core::LoadPace pace;
  if (options_.load_bytes_per_s > 0 && tables_.HeldBytes() > 0) {
    pace = [start = absl::Now(), done = int64_t{0}, rate = options_.load_bytes_per_s](
               int64_t bytes) mutable {
      done += bytes;
      const absl::Time due = start + absl::Seconds(static_cast<double>(done) / rate);
      if (const absl::Duration ahead = due - absl::Now(); ahead > absl::ZeroDuration()) {
        absl::SleepFor(ahead);
      }
    };
  }
  // A checkpoint writes every value: its shard needs no zeroing first (half the memory traffic).
  const bool checkpoint = spec.init_case() == v1::TableSpec::kCheckpoint;
  SHARDSERVE_ASSIGN_OR_RETURN(
      std::unique_ptr<core::ShardedTable> table,
      core::ShardedTable::Create(config, options_.rank, kernels_, pace, !checkpoint));
  if (checkpoint) {
    SHARDSERVE_RETURN_IF_ERROR(table->LoadCheckpoint(spec.checkpoint(), pace));
  } else {
    SHARDSERVE_RETURN_IF_ERROR(table->LoadSeeded(spec.seed()));
  }
  if (!options_.data_dir.empty()) {
    // The base, then what the log holds since: every update this rank had made durable. Named by
    // the table's creation, so a table created again under the name starts from its own base.
    const std::string dir = LogDir(spec);
    SHARDSERVE_ASSIGN_OR_RETURN(
        std::shared_ptr<core::UpdateLog> log,
        core::UpdateLog::Open(dir, *table, core::UpdateLog::Options{options_.snapshot_bytes},
                              max_agreed));
    if (table->lsn() > 0) {
      LOG(INFO) << "worker group " << options_.group << " rank " << options_.rank << ": table \""
                << spec.name() << "\" version " << spec.version() << " recovered to update "
                << table->seq() << " (log record " << table->lsn() << ") from " << dir;
    }
    table->SetLog(std::move(log));
  }
  return std::shared_ptr<core::ShardedTable>(std::move(table));
}

std::string TableDirName(const v1::TableSpec& spec) {
  // A file name holds 255 bytes at most, and a name may have 256 (and the creation time 20
  // digits): a longer one keeps its first 200 bytes, then a digest of the whole name (FNV-1a:
  // stable across builds and hosts, as the directory must be).
  const std::string created = absl::StrCat(".", spec.created());
  if (spec.name().size() + created.size() <= 255) return spec.name() + created;
  uint64_t digest = 14695981039346656037ull;
  for (unsigned char c : spec.name()) digest = (digest ^ c) * 1099511628211ull;
  return absl::StrCat(spec.name().substr(0, 200), "~", absl::Hex(digest, absl::kZeroPad16),
                      created);
}

std::string ShardStore::LogDir(const v1::TableSpec& spec) const {
  if (options_.data_dir.empty()) return std::string();
  return absl::StrCat(options_.data_dir, "/", TableDirName(spec), "/v", spec.version());
}

absl::Status ShardStore::Install(core::ShardedTable& table, const v1::TableSpec& spec,
                                const std::vector<float>& rows, const std::vector<float>& bias,
                                uint64_t sequence, uint64_t agreed) {
  // Between steps, with no log write in flight: the load becomes the copy, and its log starts
  // afresh.
  const std::string dir = LogDir(spec);
  absl::Status installed;
  loop_.RunBetweenSteps([&] {
    loop_.WaitForLogWrites();
    installed = [&]() -> absl::Status {
      if (core::UpdateLog* old = table.log(); old != nullptr) old->WaitForSnapshot().IgnoreError();
      table.SetLog(nullptr);
      if (!dir.empty()) SHARDSERVE_RETURN_IF_ERROR(core::RemoveUpdateLog(dir));
      SHARDSERVE_RETURN_IF_ERROR(table.LoadShard(rows.data()));
      table.mutable_bias() = bias;
      table.SetPosition(agreed, sequence, agreed);
      if (dir.empty()) return absl::OkStatus();
      SHARDSERVE_ASSIGN_OR_RETURN(
          std::shared_ptr<core::UpdateLog> log,
          core::UpdateLog::Open(dir, table, core::UpdateLog::Options{options_.snapshot_bytes}));
      SHARDSERVE_RETURN_IF_ERROR(log->Snapshot(table));
      log->Acknowledge(agreed);
      table.SetLog(std::move(log));
      return absl::OkStatus();
    }();
  });
  return installed;
}

void ShardStore::CollectRetiredData(const v1::internal::HeartbeatRequest& request,
                                    const v1::internal::HeartbeatResponse& response) {
  const absl::Time now = absl::Now();
  if (options_.data_dir.empty() || now < next_collection_) return;
  next_collection_ = now + absl::Seconds(1);
  std::set<std::string> named;  // table directories, and their version directories
  auto name = [&](const v1::TableSpec& spec) {
    const std::string dir = LogDir(spec);
    named.insert(dir);
    named.insert(dir.substr(0, dir.rfind('/')));
  };
  for (const v1::TableSpec& spec : response.tables()) name(spec);
  for (const v1::TableSpec& spec : response.other_versions()) name(spec);
  // What this worker held as it sent the heartbeat (a drop may still be due).
  for (const v1::TableSpec& spec : request.loaded_specs()) name(spec);
  for (const v1::TableSpec& spec : request.renorm_unsure()) name(spec);

  // Only what LogDir names is looked at: "<table>.<created>/v<version>".
  auto numbered = [](absl::string_view s, size_t from) {
    return s.size() > from && s.find_first_not_of("0123456789", from) == absl::string_view::npos;
  };
  auto directories = [](const std::string& path) {
    std::vector<std::string> out;
    if (DIR* dir = ::opendir(path.c_str()); dir != nullptr) {
      while (const dirent* e = ::readdir(dir)) {
        const std::string child = e->d_name;
        struct stat st;
        if (child == "." || child == ".." ||
            ::lstat((path + "/" + child).c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
          continue;
        }
        out.push_back(child);
      }
      ::closedir(dir);
    }
    return out;
  };
  std::set<std::string> seen;
  // Whether `path` has gone unnamed for the grace period (its clock starts now if it was named).
  auto retired = [&](const std::string& path) {
    seen.insert(path);
    if (named.count(path)) {
      unnamed_since_.erase(path);
      return false;
    }
    const absl::Time since = unnamed_since_.emplace(path, now).first->second;
    return now - since >= options_.retired_data_grace;
  };
  for (const std::string& table : directories(options_.data_dir)) {
    const size_t dot = table.rfind('.');
    if (dot == std::string::npos || !numbered(table, dot + 1)) continue;
    const std::string table_dir = absl::StrCat(options_.data_dir, "/", table);
    for (const std::string& version : directories(table_dir)) {
      if (version[0] != 'v' || !numbered(version, 1)) continue;
      const std::string dir = absl::StrCat(table_dir, "/", version);
      if (!retired(dir)) continue;
      if (absl::Status removed = core::RemoveUpdateLog(dir); !removed.ok()) {
        LOG(WARNING) << "worker group " << options_.group << " rank " << options_.rank
                     << ": could not remove retired data " << dir << ": " << removed
                     << " (tried again in " << options_.retired_data_grace << ")";
        unnamed_since_[dir] = now;
        continue;
      }
      unnamed_since_.erase(dir);
      LOG(INFO) << "worker group " << options_.group << " rank " << options_.rank
                << ": removed " << dir << " (its table version is no longer held)";
    }
    if (retired(table_dir) && ::rmdir(table_dir.c_str()) == 0) unnamed_since_.erase(table_dir);
  }
  for (auto it = unnamed_since_.begin(); it != unnamed_since_.end();) {
    it = seen.count(it->first) ? std::next(it) : unnamed_since_.erase(it);
  }
}

}  // namespace shardserve::server
