#include "rpc/routing/replica_router.h"

#include <algorithm>
#include <utility>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"

namespace shardserve::rpc {
namespace {

// Map reads after failures come at most this often (many calls fail together).
constexpr absl::Duration kMinRefreshGap = absl::Milliseconds(50);

}  // namespace

ReplicaRouter::ReplicaRouter(MapSource source, Options options)
    : source_(std::move(source)), options_(options), refresher_([this] { RefreshLoop(); }) {}

ReplicaRouter::~ReplicaRouter() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  refresher_.join();
}

std::vector<ReplicaRouter::Replica> ReplicaRouter::ReplicasOf(const v1::TableInfo& info) {
  auto replica = [](int group, bool serving,
                    const google::protobuf::RepeatedPtrField<v1::ShardInfo>& shards) {
    Replica r;
    r.group = group;
    r.serving = serving;
    for (const v1::ShardInfo& s : shards) {
      if (!s.address().empty() &&
          std::find(r.addresses.begin(), r.addresses.end(), s.address()) == r.addresses.end()) {
        r.addresses.push_back(s.address());
      }
    }
    return r;
  };
  std::vector<Replica> replicas;
  for (const v1::ReplicaInfo& r : info.replicas()) {
    replicas.push_back(replica(r.group(), r.state() == v1::TABLE_STATE_SERVING, r.shards()));
  }
  if (replicas.empty()) {  // a coordinator that knows no replicas: its one group
    replicas.push_back(replica(0, info.state() == v1::TABLE_STATE_SERVING, info.shards()));
  }
  return replicas;
}

void ReplicaRouter::Update(const std::string& table, const v1::TableInfo& info) {
  Routes& routes = tables_[table];
  std::vector<Replica> replicas = ReplicasOf(info);
  for (Replica& r : replicas) {
    for (const Replica& old : routes.replicas) {
      if (old.group != r.group) continue;
      r.suspect = old.suspect;
      r.suspect_until = old.suspect_until;
      r.probing = old.probing;
    }
  }
  // (Health carried over counts as before; groups the map no longer has count no more.)
  for (Replica& old : routes.replicas) {
    bool kept = false;
    for (const Replica& r : replicas) kept = kept || r.group == old.group;
    if (!kept) SetHealth(old, false, false);
  }
  routes.replicas = std::move(replicas);
  routes.stale = false;
}

void ReplicaRouter::SetHealth(Replica& r, bool suspect, bool probing) {
  const bool was = r.suspect || r.probing;
  r.suspect = suspect;
  r.probing = probing;
  const bool is = r.suspect || r.probing;
  if (was != is) unhealthy_.fetch_add(is ? 1 : -1, std::memory_order_relaxed);
}

ReplicaRouter::Replica* ReplicaRouter::Find(const std::string& table, int group) {
  auto it = tables_.find(table);
  if (it == tables_.end()) return nullptr;
  for (Replica& r : it->second.replicas) {
    if (r.group == group) return &r;
  }
  return nullptr;
}

absl::StatusOr<ReplicaRouter::Route> ReplicaRouter::Pick(const std::string& table,
                                                        absl::Span<const int> avoid,
                                                        bool serving_only) {
  absl::MutexLock lock(&mu_);
  auto it = tables_.find(table);
  if (it == tables_.end()) {
    mu_.Unlock();
    absl::StatusOr<v1::TableInfo> info = source_(table);
    mu_.Lock();
    if (!info.ok()) return info.status();
    Update(table, *info);
    it = tables_.find(table);
  }
  Routes& routes = it->second;
  const absl::Time now = absl::Now();
  auto usable = [&avoid](const Replica& r) {
    return !r.addresses.empty() && std::find(avoid.begin(), avoid.end(), r.group) == avoid.end();
  };
  // First a suspect group's probe, once its cooldown is over and the map says it serves (one call
  // at a time); then the healthy replicas that serve; then any left.
  absl::InlinedVector<Replica*, 4> tier;  // (no allocation per call)
  bool probe = false;
  for (Replica& r : routes.replicas) {
    if (usable(r) && r.serving && r.suspect && !r.probing && now >= r.suspect_until) {
      tier.push_back(&r);
      probe = true;
      break;
    }
  }
  if (tier.empty()) {
    for (Replica& r : routes.replicas) {
      if (usable(r) && r.serving && !r.suspect) tier.push_back(&r);
    }
  }
  if (tier.empty() && !serving_only) {
    for (Replica& r : routes.replicas) {
      if (usable(r)) tier.push_back(&r);
    }
  }
  if (tier.empty()) {
    if (avoid.empty()) {  // nowhere to go at all: read the map again soon
      routes.stale = true;
      wake_ = true;
    }
    return absl::UnavailableError(
        routes.replicas.empty() || avoid.empty()
            ? absl::StrCat("table \"", table, "\" has no workers yet")
            : absl::StrCat("every replica of table \"", table, "\" failed this call"));
  }
  size_t total = 0;
  for (const Replica* r : tier) total += r->addresses.size();
  size_t k = routes.next++ % total;
  for (Replica* r : tier) {
    if (k < r->addresses.size()) {
      if (probe) SetHealth(*r, r->suspect, true);
      bool alternatives = false;
      for (const Replica& other : routes.replicas) {
        alternatives = alternatives || (usable(other) && other.group != r->group);
      }
      return Route{r->group, r->addresses[k], probe, alternatives};
    }
    k -= r->addresses.size();
  }
  return absl::InternalError("unreachable");
}

void ReplicaRouter::Succeeded(const std::string& table, const Route& route) {
  if (!route.probe && unhealthy_.load(std::memory_order_relaxed) == 0) return;
  absl::MutexLock lock(&mu_);
  Replica* r = Find(table, route.group);
  if (r == nullptr) return;
  SetHealth(*r, false, false);
}

void ReplicaRouter::Failed(const std::string& table, const Route& route) {
  absl::MutexLock lock(&mu_);
  auto it = tables_.find(table);
  if (it == tables_.end()) return;
  it->second.stale = true;
  wake_ = true;
  Replica* r = Find(table, route.group);
  if (r == nullptr) return;
  r->suspect_until = absl::Now() + options_.cooldown;
  SetHealth(*r, true, route.probe ? false : r->probing);
}

void ReplicaRouter::Abandoned(const std::string& table, const Route& route) {
  if (!route.probe) return;
  absl::MutexLock lock(&mu_);
  if (Replica* r = Find(table, route.group)) SetHealth(*r, r->suspect, false);
}

bool ReplicaRouter::Suspect(const std::string& table, int group) {
  absl::MutexLock lock(&mu_);
  const Replica* r = Find(table, group);
  return r != nullptr && r->suspect;
}

int ReplicaRouter::Replicas(const std::string& table) {
  absl::MutexLock lock(&mu_);
  auto it = tables_.find(table);
  return it == tables_.end() ? 0 : static_cast<int>(it->second.replicas.size());
}

void ReplicaRouter::Forget(const std::string& table) {
  absl::MutexLock lock(&mu_);
  auto it = tables_.find(table);
  if (it == tables_.end()) return;
  for (Replica& r : it->second.replicas) SetHealth(r, false, false);
  tables_.erase(it);
}

void ReplicaRouter::RefreshLoop() {
  absl::MutexLock lock(&mu_);
  while (!stop_) {
    auto woken = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_ || wake_; };
    mu_.AwaitWithTimeout(absl::Condition(&woken), options_.refresh);
    if (stop_) return;
    wake_ = false;
    std::vector<std::string> names;
    for (const auto& [name, routes] : tables_) names.push_back(name);
    for (const std::string& name : names) {
      mu_.Unlock();
      absl::StatusOr<v1::TableInfo> info = source_(name);
      mu_.Lock();
      if (stop_) return;
      if (info.ok()) {
        if (tables_.count(name)) Update(name, *info);
      } else if (auto it = tables_.find(name);
                 it != tables_.end() && info.status().code() == absl::StatusCode::kNotFound) {
        // Dropped: callers get NOT_FOUND from their next first read.
        for (Replica& r : it->second.replicas) SetHealth(r, false, false);
        tables_.erase(it);
      }
    }
    // (Unlocked while it sleeps: failures meanwhile set wake_ for the next round.)
    mu_.Unlock();
    absl::SleepFor(kMinRefreshGap);
    mu_.Lock();
  }
}

}  // namespace shardserve::rpc
