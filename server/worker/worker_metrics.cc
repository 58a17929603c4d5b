#include "server/worker/worker_metrics.h"

#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "server/common/metrics.h"

namespace shardserve::server {

std::vector<prometheus::MetricFamily> WorkerStateFamilies(const WorkerPlace& place,
                                                          const core::StepLoop& loop,
                                                          const TableLifecycle& tables) {
  std::vector<prometheus::MetricFamily> out;
  prometheus::MetricFamily info = GaugeFamily(
      "shardserve_worker_info", "This worker's place: its replica group, rank and device.");
  AddSample(info, 1,
            {{"group", absl::StrCat("g", place.group)},
             {"rank", std::to_string(place.rank)},
             {"device", place.device}});
  out.push_back(std::move(info));
  prometheus::MetricFamily serving = GaugeFamily(
      "shardserve_group_serving", "1 while this worker's group is formed and runs steps.");
  AddSample(serving, loop.serving() ? 1 : 0);
  out.push_back(std::move(serving));
  prometheus::MetricFamily epoch =
      GaugeFamily("shardserve_group_epoch", "The group epoch this worker runs steps in (0: none).");
  AddSample(epoch, static_cast<double>(loop.epoch()));
  out.push_back(std::move(epoch));
  const auto [requests, bytes] = loop.queued();
  prometheus::MetricFamily queued =
      GaugeFamily("shardserve_queue_requests", "Requests queued for a step.");
  AddSample(queued, static_cast<double>(requests));
  out.push_back(std::move(queued));
  prometheus::MetricFamily queued_bytes =
      GaugeFamily("shardserve_queue_bytes", "Input bytes of the requests queued for a step.");
  AddSample(queued_bytes, static_cast<double>(bytes));
  out.push_back(std::move(queued_bytes));
  // One series per table and phase, 1 for the phase it is in (Prometheus' way with enums).
  static constexpr std::pair<TableLifecycle::Phase, const char*> kPhases[] = {
      {TableLifecycle::Phase::kLoading, "loading"},
      {TableLifecycle::Phase::kLoaded, "loaded"},
      {TableLifecycle::Phase::kServing, "serving"},
      {TableLifecycle::Phase::kFailed, "failed"},
      {TableLifecycle::Phase::kRenormUnsure, "renorm_unsure"}};
  prometheus::MetricFamily phases = GaugeFamily(
      "shardserve_table_phase",
      "1 for the phase each table is in on this rank: loading, loaded (this rank holds its "
      "shard), serving (every rank does), failed (could not load), renorm_unsure.");
  for (const auto& [table, phase] : tables.Phases()) {
    for (const auto& [p, name] : kPhases) {
      AddSample(phases, p == phase ? 1 : 0, {{"table", table}, {"phase", name}});
    }
  }
  out.push_back(std::move(phases));
  prometheus::MetricFamily sequence = GaugeFamily(
      "shardserve_table_update_sequence",
      "Updates applied to each table version this rank holds (UpdateRows calls since its base).");
  prometheus::MetricFamily log_bytes = GaugeFamily(
      "shardserve_update_log_bytes",
      "Bytes of each table version's update log on this rank since its last snapshot.");
  for (const TableLifecycle::UpdatePosition& p : tables.UpdatePositions()) {
    const std::vector<prometheus::ClientMetric::Label> labels = {
        {"table", p.table}, {"version", std::to_string(p.version)}};
    AddSample(sequence, static_cast<double>(p.sequence), labels);
    if (p.log_bytes >= 0) AddSample(log_bytes, static_cast<double>(p.log_bytes), labels);
  }
  out.push_back(std::move(sequence));
  out.push_back(std::move(log_bytes));
  return out;
}

}  // namespace shardserve::server
