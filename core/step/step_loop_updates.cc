// StepLoop: updates' way through a step (step_loop.h) - applied on every rank in the agreed order,
// logged, handed to the LogSyncer, and answered once every rank says it synced past their round.
#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/step/log_syncer.h"
#include "core/step/step_loop.h"
#include "core/step/step_loop_state.h"
#include "core/step/step_protocol.h"
#include "core/step/update_message.h"
#include "core/table/update_log.h"

namespace shardserve::core {

// Applies every rank's update calls for one table in rank order (each rank its part of the rows),
// logging them; this rank's are answered in Acknowledge, once every rank synced them.
void StepLoop::RunUpdates(Group& group, Step& step, const WorkKey& key,
                          std::vector<absl::Span<const char>>& inputs,
                          const std::shared_ptr<ShardedTable>& table) {
  const std::vector<int64_t> empty = EmptyUpdateMessage();
  for (absl::Span<const char>& input : inputs) {
    if (input.data() == nullptr) input = AsBytes(empty);
  }
  auto m = step.mine.find(key);
  const std::vector<size_t> none;
  const std::vector<size_t>& indices = m != step.mine.end() ? m->second : none;
  absl::StatusOr<std::vector<std::vector<UpdateCall>>> calls =
      DecodeUpdates(table->config(), inputs);
  if (!calls.ok()) {  // every rank read the same messages: every rank fails them alike
    for (size_t i : indices) Answer(step.batch[i], calls.status());
    return;
  }
  const int me = group.transports.channel->rank();
  step.renorm_unsure.push_back(table);  // should the step fail before every rank has them
  for (int q = 0; q < static_cast<int>(calls->size()); ++q) {
    const std::vector<UpdateCall>& theirs = (*calls)[q];
    for (size_t c = 0; c < theirs.size(); ++c) {
      const bool mine = q == me && c < indices.size();
      if (const uint64_t expected = theirs[c].expected_seq;
          expected != 0 && table->seq() + 1 != expected) {
        // Every rank holds the same sequence: every rank skips it alike.
        if (mine) {
          Answer(step.batch[indices[c]],
                 absl::FailedPreconditionError(absl::StrCat(
                     "update ", expected, " of table \"", key.table, "\" comes after update ",
                     table->seq(), " here: it is out of order and was not applied")));
        }
        continue;
      }
      if (absl::Status applied = ApplyUpdate(*table, theirs[c]); !applied.ok()) {
        step.broken = absl::UnavailableError(
            absl::StrCat("rank ", me, " could not apply an update: ", applied.message()));
        return;
      }
      if (!mine) continue;
      StepRequest& r = *step.batch[indices[c]];
      r.served_version = table->config().version;
      r.served_seq = table->seq();
      step.updated.push_back(indices[c]);
    }
  }
}

// Hands the step's update log records to the syncer, and keeps its update requests until every
// rank says it synced past this round (Acknowledge): an answered update is on every rank's disk.
void StepLoop::StartSync(Group& group, Step& step) {
  LogSyncer::Records records;
  Group::PendingAck ack;
  ack.round = group.round;
  for (const std::shared_ptr<ShardedTable>& table : step.loads) {
    UpdateLog* log = table->log();
    if (log == nullptr || !log->pending()) continue;
    records.emplace_back(table, log->TakePending());
    ack.logged.emplace_back(table, table->agreed());
  }
  for (size_t i : step.updated) ack.requests.push_back(std::move(step.batch[i]));
  step.updated.clear();
  // Tables the step updated stay unsure (should the group fail) until acknowledged.
  for (const std::shared_ptr<ShardedTable>& table : step.renorm_unsure) {
    if (std::none_of(ack.logged.begin(), ack.logged.end(),
                     [&](const auto& l) { return l.first == table; })) {
      ack.logged.emplace_back(table, table->agreed());
    }
  }
  step.renorm_unsure.clear();
  if (!records.empty()) syncer_->Add(group.round, std::move(records));
  if (ack.requests.empty() && ack.logged.empty()) return;
  group.acks.push_back(std::move(ack));
  group.round_due = true;  // the next round tells the peers (and this rank) how far each synced
}

// After a round: answers the updates (and acknowledges the logs) of the rounds every rank has
// synced past; a rank that could not sync its log breaks the group.
void StepLoop::Acknowledge(Group& group, Step& step) {
  const std::vector<int64_t>& synced = step.agreement->synced();
  int64_t least = std::numeric_limits<int64_t>::max();
  for (size_t q = 0; q < synced.size(); ++q) {
    if (synced[q] < 0) {
      const absl::Status mine = syncer_->failed();
      step.broken = absl::UnavailableError(absl::StrCat(
          "rank ", q, " could not sync its update log",
          mine.ok() ? std::string() : absl::StrCat(": ", mine.message())));
      return;
    }
    least = std::min(least, synced[q]);
  }
  bool acknowledged = false;
  while (!group.acks.empty() && group.acks.front().round <= least) {
    Group::PendingAck& ack = group.acks.front();
    for (const auto& [table, agreed] : ack.logged) {
      if (table->log() != nullptr) table->log()->Acknowledge(agreed);
    }
    for (std::unique_ptr<StepRequest>& r : ack.requests) Answer(r, DenseResult{});
    for (const auto& [table, agreed] : ack.logged) {
      // Between steps, with no write of its records in flight; a failed snapshot leaves the log
      // as it is, to be tried again.
      if (table->log() != nullptr && syncer_->Idle()) {
        table->log()->MaybeSnapshot(*table).IgnoreError();
      }
    }
    group.acks.pop_front();
    acknowledged = true;
  }
  if (acknowledged) sink_.Flush();
}

// The group is gone before every rank synced these updates: they are answered `status`, and
// their tables handed back as unsure (reloaded from the logs, which the coordinator cuts to the
// shortest before the group serves them).
void StepLoop::FailPendingAcks(Group& group, const absl::Status& status) {
  if (group.acks.empty()) return;
  syncer_->WaitUntilIdle();  // nothing writes the logs while the tables are reloaded
  for (Group::PendingAck& ack : group.acks) {
    for (std::unique_ptr<StepRequest>& r : ack.requests) Answer(r, status);
    for (const auto& [table, agreed] : ack.logged) tables_.DropRenormUnsure(table);
  }
  group.acks.clear();
  sink_.Flush();
}

}  // namespace shardserve::core
