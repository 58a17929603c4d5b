#include "core/step/table_source.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace shardserve::core {
namespace {

// FNV-1a: the same in every process (absl::Hash is seeded per process).
uint64_t Fnv1a(absl::string_view bytes, uint64_t h = 14695981039346656037ull) {
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

int64_t TableIdentity(const TableConfig& c) {
  auto bits = [](double d) {
    int64_t b = 0;
    std::memcpy(&b, &d, sizeof(b));
    return b;
  };
  return static_cast<int64_t>(Fnv1a(absl::StrCat(
      c.name, "\n", static_cast<int>(c.kind), "|", c.num_rows, "|", c.num_cols, "|",
      c.spec.ToString(), "|", c.padding_idx.value_or(-1), "|", c.max_norm.has_value(), "|",
      bits(c.max_norm.value_or(0)), "|", bits(c.norm_type), "|", c.has_bias, "|", c.version, "\n",
      c.source)));
}

std::shared_ptr<const TableSet> TableSet::Of(std::map<std::string, Versions> tables) {
  auto set = std::make_shared<TableSet>();
  set->tables = std::move(tables);
  set->digest = Fnv1a("");
  auto mix = [&](int64_t word) {
    set->digest = Fnv1a(absl::string_view(reinterpret_cast<const char*>(&word), 8), set->digest);
  };
  for (const auto& [name, versions] : set->tables) {
    for (const auto& [version, table] : versions.loads) {
      if (version <= versions.active) mix(TableIdentity(table->config()));
    }
    mix(static_cast<int64_t>(versions.active));
  }
  return set;
}

std::shared_ptr<ShardedTable> TableSet::Find(const std::string& name, uint64_t version) const {
  auto it = tables.find(name);
  if (it == tables.end()) return nullptr;
  const uint64_t want = version == 0 ? it->second.active : version;
  if (want > it->second.active) return nullptr;  // staged
  auto load = it->second.loads.find(want);
  return load == it->second.loads.end() ? nullptr : load->second;
}

std::shared_ptr<ShardedTable> TableSet::Load(const std::string& name, uint64_t version) const {
  auto it = tables.find(name);
  if (it == tables.end()) return nullptr;
  auto load = it->second.loads.find(version);
  return load == it->second.loads.end() ? nullptr : load->second;
}

FixedTables::FixedTables() : tables_(TableSet::Of({})) {}

void FixedTables::Set(std::shared_ptr<ShardedTable> table) {
  absl::MutexLock lock(&mu_);
  auto tables = tables_->tables;
  TableSet::Versions& versions = tables[table->config().name];
  versions.loads.clear();
  versions.active = table->config().version;
  versions.loads[versions.active] = std::move(table);
  tables_ = TableSet::Of(std::move(tables));
}

void FixedTables::Stage(std::shared_ptr<ShardedTable> table) {
  absl::MutexLock lock(&mu_);
  auto tables = tables_->tables;
  const uint64_t version = table->config().version;
  tables[table->config().name].loads[version] = std::move(table);
  tables_ = TableSet::Of(std::move(tables));
}

void FixedTables::Activate(const std::string& name, uint64_t version) {
  absl::MutexLock lock(&mu_);
  auto tables = tables_->tables;
  tables[name].active = version;
  tables_ = TableSet::Of(std::move(tables));
}

void FixedTables::Drop(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto tables = tables_->tables;
  tables.erase(name);
  tables_ = TableSet::Of(std::move(tables));
}

void FixedTables::Drop(const std::string& name, uint64_t version) {
  absl::MutexLock lock(&mu_);
  auto tables = tables_->tables;
  auto it = tables.find(name);
  if (it == tables.end()) return;
  it->second.loads.erase(version);
  if (it->second.loads.empty()) tables.erase(it);
  tables_ = TableSet::Of(std::move(tables));
}

std::shared_ptr<const TableSet> FixedTables::Tables() const {
  absl::MutexLock lock(&mu_);
  return tables_;
}

void FixedTables::DropRenormUnsure(const std::shared_ptr<ShardedTable>& table) {
  absl::MutexLock lock(&mu_);
  auto tables = tables_->tables;
  auto it = tables.find(table->config().name);
  if (it == tables.end()) return;
  auto load = it->second.loads.find(table->config().version);
  if (load == it->second.loads.end() || load->second != table) return;  // loaded anew: kept
  it->second.loads.erase(load);
  if (it->second.loads.empty()) tables.erase(it);
  tables_ = TableSet::Of(std::move(tables));
}

}  // namespace shardserve::core
