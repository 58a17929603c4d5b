#include "core/table_source.h"

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
      bits(c.max_norm.value_or(0)), "|", bits(c.norm_type), "|", c.has_bias, "\n", c.source)));
}

std::shared_ptr<const TableSet> TableSet::Of(
    std::map<std::string, std::shared_ptr<ShardedTable>> tables) {
  auto set = std::make_shared<TableSet>();
  set->tables = std::move(tables);
  set->digest = Fnv1a("");
  for (const auto& [name, table] : set->tables) {
    const int64_t identity = TableIdentity(table->config());
    set->digest =
        Fnv1a(absl::string_view(reinterpret_cast<const char*>(&identity), 8), set->digest);
  }
  return set;
}

FixedTables::FixedTables() : tables_(TableSet::Of({})) {}

void FixedTables::Set(std::shared_ptr<ShardedTable> table) {
  absl::MutexLock lock(&mu_);
  auto tables = tables_->tables;
  tables[table->config().name] = std::move(table);
  tables_ = TableSet::Of(std::move(tables));
}

void FixedTables::Drop(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto tables = tables_->tables;
  tables.erase(name);
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
  if (it == tables.end() || it->second != table) return;  // loaded anew meanwhile: kept
  tables.erase(it);
  tables_ = TableSet::Of(std::move(tables));
}

}  // namespace shardserve::core
