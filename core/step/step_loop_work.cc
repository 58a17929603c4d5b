// StepLoop: the agreed work of a step (step_loop.h) - which load each (table, op) runs on, alike
// on every rank; the sharded ops, run in the agreed order; and each request's rows of the result,
// answered without a copy. Updates take their own way from here (step_loop_updates.cc).
#include <algorithm>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/base/status_macros.h"
#include "core/ops/input_message.h"
#include "core/ops/sharded_ops.h"
#include "core/step/step_loop.h"
#include "core/step/step_loop_state.h"
#include "core/step/step_protocol.h"

namespace shardserve::core {

// Runs every agreed (table, op) in order - each rank with its input for it, possibly none - and
// answers this rank's requests from the results.
void StepLoop::RunOps(Group& group, Step& step) {
  Agreement& agreement = *step.agreement;
  auto& work = agreement.work();
  // Which load each key runs on, decided from what every rank said, so alike on every rank. When
  // the ranks hold different tables (one being created, replaced or dropped, a version staged or
  // switched to), they first tell each other which they hold; work for a table (version) not every
  // rank holds alike is answered UNAVAILABLE on every rank.
  std::optional<std::map<std::string, HeldAlike>> alike;
  if (!agreement.same_tables()) {
    agreement.Own();  // the second round reuses the channel's buffers
    const std::vector<int64_t> held = HeldTablesMessage(*step.tables);
    absl::StatusOr<std::vector<absl::Span<const char>>> messages =
        group.transports.channel->AllGatherMessages(AsBytes(held), options_.collective_timeout);
    absl::StatusOr<std::map<std::string, HeldAlike>> read =
        messages.ok() ? TablesHeldAlike(*messages)
                      : absl::StatusOr<std::map<std::string, HeldAlike>>(messages.status());
    if (!read.ok()) {
      step.broken = read.status();
      return;
    }
    alike = *std::move(read);
  }
  step.loads.clear();
  for (auto it = work.begin(); it != work.end();) {
    const WorkKey& key = it->first;
    std::shared_ptr<ShardedTable> table;
    if (!alike) {
      table = step.tables->Find(key.table, key.version);
    } else if (auto h = alike->find(key.table); h != alike->end()) {
      const std::optional<uint64_t> version = h->second.Resolve(key.version);
      if (version) table = step.tables->Load(key.table, *version);
    }
    if (table != nullptr) {
      step.loads.push_back(std::move(table));
      ++it;
      continue;
    }
    const std::string what =
        key.version == 0 ? absl::StrCat("table \"", key.table, "\"")
                         : absl::StrCat("version ", key.version, " of table \"", key.table, "\"");
    const absl::Status refused =
        alike ? absl::UnavailableError(absl::StrCat(
                    what, " is not the same on every rank of the group right now (it is being "
                          "created, replaced or dropped); retry"))
              : absl::NotFoundError(absl::StrCat(what, " is not loaded"));
    if (auto m = step.mine.find(key); m != step.mine.end()) {
      for (size_t i : m->second) Answer(step.batch[i], refused);
    }
    it = work.erase(it);
  }
  if (!work.empty()) {
    absl::MutexLock lock(&mu_);
    ++busy_steps_;
  }
  StepObserver* observer = work.empty() ? nullptr : options_.observer;
  StepStats stats;
  const absl::Time ops_start = observer ? absl::Now() : absl::InfinitePast();
  if (observer != nullptr) {
    for (const auto& [key, indices] : step.mine) {
      if (!work.count(key)) continue;
      for (size_t i : indices) {
        const StepRequest& r = *step.batch[i];
        ++stats.requests;
        stats.rows += r.Rows();
        stats.input_bytes += r.InputBytes();
        if (r.received != absl::InfinitePast()) {
          observer->QueueWaited(step.round_start - r.received);
        }
      }
    }
    group.timed_data->Take();
    if (group.timed_control != group.timed_data) group.timed_control->Take();
  }
  const StepGroup& t = group.transports;
  Collectives& control = group.timed_control ? *group.timed_control : *t.control;
  Collectives& data = group.timed_data ? *group.timed_data : *t.data;
  ShardedOps ops(control, data, kernels_, OpOptions{options_.collective_timeout, options_.limits});
  RunWork(group, step, ops);
  if (step.broken.ok()) StartSync(group, step);
  if (observer == nullptr || !step.broken.ok()) return;
  stats.agreement = step.agreement_time;
  stats.exchange = group.timed_data->Take();
  if (group.timed_control != group.timed_data) stats.exchange += group.timed_control->Take();
  stats.compute = std::max(absl::Now() - ops_start - stats.exchange, absl::ZeroDuration());
  observer->StepDone(stats);
}

// Runs the agreed work with `ops` and answers this rank's requests.
void StepLoop::RunWork(Group& group, Step& step, ShardedOps& ops) {
  auto& work = step.agreement->work();
  size_t k = 0;
  for (auto& [key, inputs] : work) {
    const std::shared_ptr<ShardedTable>& table = step.loads[k++];
    const TableConfig& config = table->config();
    if (key.op == StepRequest::Op::kUpdate) {
      // Updates sort after lookups: the step's lookup answers (which do not reflect its updates)
      // go out now, not after the updates are applied and logged.
      sink_.Flush();
      RunUpdates(group, step, key, inputs, table);
      if (!step.broken.ok()) return;
      continue;
    }
    // Ranks without work for this key sent no input: theirs is the empty one.
    std::vector<int64_t> empty;
    for (absl::Span<const char>& input : inputs) {
      if (input.data() != nullptr) continue;
      if (empty.empty()) empty = EmptyInput(key.kind(), key.mode);
      input = AsBytes(empty);
    }
    auto m = step.mine.find(key);
    const std::vector<size_t> none;
    const std::vector<size_t>& indices = m != step.mine.end() ? m->second : none;
    for (size_t i : indices) {
      step.batch[i]->served_version = config.version;
      step.batch[i]->served_seq = table->seq();
    }
    absl::StatusOr<DenseResult> result = [&]() -> absl::StatusOr<DenseResult> {
      SHARDSERVE_ASSIGN_OR_RETURN(GatheredInputs gathered,
                                  DecodeInputs(key.kind(), config, inputs));
      switch (key.op) {
        case StepRequest::Op::kEmbedding:
          return ops.Embedding(*table, gathered);
        case StepRequest::Op::kEmbeddingBag:
          return ops.EmbeddingBag(*table, gathered);
        case StepRequest::Op::kLinear:
        case StepRequest::Op::kUpdate:
          break;
      }
      return ops.Linear(*table, gathered);
    }();
    if (!result.ok()) {
      if (result.status().code() == absl::StatusCode::kUnavailable) {
        if (config.max_norm.has_value() && config.spec.dim() == 1) {
          step.renorm_unsure.push_back(table);
        }
        step.broken = result.status();
        return;
      }
      // Every rank read the same inputs, so every rank fails this op alike: the group goes on.
      for (size_t i : indices) Answer(step.batch[i], result.status());
      continue;
    }
    // Split the rows back per request: with several requests, each refers to its rows of the one
    // result buffer (no copy).
    const int64_t dim = result->shape.back();
    std::shared_ptr<const FloatBuffer> shared;
    if (indices.size() > 1) shared = std::make_shared<FloatBuffer>(std::move(result->values));
    int64_t cursor = 0;
    for (size_t i : indices) {
      StepRequest& r = *step.batch[i];
      DenseResult answer;
      const int64_t rows = r.AnswerRows();
      switch (r.op) {
        case StepRequest::Op::kEmbedding:
          answer.shape = r.shape;
          break;
        case StepRequest::Op::kEmbeddingBag:
          answer.shape = {rows};
          break;
        case StepRequest::Op::kLinear:
        case StepRequest::Op::kUpdate:
          answer.shape.assign(r.shape.begin(), r.shape.end() - 1);
          break;
      }
      answer.shape.push_back(dim);
      if (shared == nullptr) {
        answer.values = std::move(result->values);
      } else {
        answer.shared = shared;
        answer.offset = cursor;
        answer.count = rows * dim;
        cursor += rows * dim;
      }
      Answer(step.batch[i], std::move(answer));
    }
  }
}

}  // namespace shardserve::core
