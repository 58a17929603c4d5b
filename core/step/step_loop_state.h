// StepLoop's state of a group and of one iteration (Group, Step), which the loop's files share:
// step_loop.cc (the loop and its rounds), step_loop_work.cc (the agreed work of a step) and
// step_loop_updates.cc (updates' way through a step). Only those include it.
#ifndef SHARDSERVE_CORE_STEP_STEP_LOOP_STATE_H_
#define SHARDSERVE_CORE_STEP_STEP_LOOP_STATE_H_

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/step/step_loop.h"
#include "core/step/step_observer.h"
#include "core/step/step_protocol.h"
#include "core/step/table_source.h"
#include "core/table/sharded_table.h"

namespace shardserve::core {

// The group the loop runs with, and what its rounds remember from one to the next.
struct StepLoop::Group {
  StepGroup transports;  // channel null: no group
  // With an observer: the ops' collectives, timed (transports' control and data, wrapped).
  std::shared_ptr<TimedCollectives> timed_control, timed_data;
  bool hello_due = false;  // a new group's first round is the hello
  int turn = -1;  // one_request_per_step: the rank whose request the last busy step ran
  int idle_rounds = 0;  // consecutive rounds without work
  absl::Duration idle = absl::ZeroDuration();  // the back-off of groups that do not park cheaply
  // A group that parks cheaply has no idle rounds: AwaitRound returned, so the next round runs
  // (a peer may have started it) whether or not this rank has work by then.
  bool round_due = false;
  int64_t round = 0;  // agreement rounds of this group so far: alike on every rank
  // Steps whose update log records wait for every rank's sync (LogSyncer): their update requests
  // are answered, and their loads' logs acknowledged, once every rank says it synced past them.
  struct PendingAck {
    int64_t round = 0;
    std::vector<std::unique_ptr<StepRequest>> requests;
    std::vector<std::pair<std::shared_ptr<ShardedTable>, uint64_t>> logged;  // load, agreed
  };
  std::deque<PendingAck> acks;

  bool formed() const { return transports.channel != nullptr; }
  void Abort() const {
    transports.channel->Abort().IgnoreError();
    transports.control->Abort().IgnoreError();
    transports.data->Abort().IgnoreError();
  }
};

// One iteration of the loop: this rank's requests, the tables it runs on, and what the round
// agreed.
struct StepLoop::Step {
  // This rank's requests; null once answered.
  std::vector<std::unique_ptr<StepRequest>> batch;
  // The tables this step runs on; released before the loop waits (a dropped table's memory must
  // not outlive the steps that use it).
  std::shared_ptr<const TableSet> tables;
  std::map<WorkKey, std::vector<size_t>> mine;  // this rank's work: indices into `batch`
  std::optional<Agreement> agreement;
  // The load each key of the agreed work runs on, in the work's order (the same table version on
  // every rank).
  std::vector<std::shared_ptr<ShardedTable>> loads;
  // For the observer: when the round began, and how long the agreement took.
  absl::Time round_start;
  absl::Duration agreement_time;
  // Tables whose rows this rank may hold renormed or updated unlike its peers, should the step
  // fail.
  std::vector<std::shared_ptr<ShardedTable>> renorm_unsure;
  // This rank's update requests the step applied: answered once every rank has them durably.
  std::vector<size_t> updated;
  absl::Status broken;  // the group failed

  std::vector<StepRequest*> Requests(const std::vector<size_t>& indices) const {
    std::vector<StepRequest*> out;
    for (size_t i : indices) out.push_back(batch[i].get());
    return out;
  }
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_STEP_STEP_LOOP_STATE_H_
