// StepLoop: a worker's executor (docs/design/step-loop.md). Each iteration the ranks of the group
// meet in an agreement round (step_protocol.h: which (table, op) work each rank has
// queued, with its input); if any rank has work, every rank runs each sharded op in the agreed
// order with whatever it has queued for it (possibly nothing), and answers its own callers.
//
// Idle groups do not spin. A group whose channel wakes cheaply (ranks that share memory ring each
// other's doorbells) runs no idle rounds: a rank without work waits (StepChannel::AwaitRound)
// until a peer starts the next round or it has news itself - a request, a new group, a task
// between steps, Stop, or the periodic check (Options::park_check) that finds peers gone. Other
// idle groups back off (up to Options::max_idle_sleep between rounds) and, after
// Options::park_after_idle_rounds idle rounds, park (StepChannel::Park) until any rank has news.
//
// Answers leave through each request's Responder (StepRequest::responder), and the ResponseSink
// is told (Flush) once the answers given so far may go out together: after every round, and
// before the loop waits on its peers (core/step/responder.h).
//
// Thread-safety: Submit, SetGroup, RunBetweenSteps and Stop may be called from any
// thread; everything else runs on the loop's own thread, which calls LocalKernels::InitThread()
// first. Every accepted request is answered exactly once, through its Responder: on the loop's
// thread, on BreakGroup's, or on Stop's. A failed collective fails the step's requests and the
// queue with UNAVAILABLE and drops the group; tables whose rows the failed step may have renormed
// unlike on the peers are handed back to the TableSource (DropRenormUnsure);
// Options::on_group_broken reports it, and the loop waits for SetGroup.
#ifndef SHARDSERVE_CORE_STEP_STEP_LOOP_H_
#define SHARDSERVE_CORE_STEP_STEP_LOOP_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/comm/collectives.h"
#include "core/comm/step_channel.h"
#include "core/kernels/local_kernels.h"
#include "core/ops/op_inputs.h"
#include "core/step/responder.h"
#include "core/step/step_observer.h"
#include "core/step/step_request.h"
#include "core/step/table_source.h"

namespace shardserve::core {

class LogSyncer;
class ShardedOps;
struct WorkKey;

// The transports of one formed group.
struct StepGroup {
  std::shared_ptr<StepChannel> channel;  // agreement rounds and idle waiting
  std::shared_ptr<Collectives> control;  // the ops' host-memory collectives (renorms)
  std::shared_ptr<Collectives> data;     // results, in the kernels' memory (may be `control`)

  // A group whose one communicator is all three (Gloo, for CPU ranks).
  template <typename T>
  static StepGroup Over(std::shared_ptr<T> both) {
    return StepGroup{both, both, both};
  }
};

class StepLoop {
 public:
  struct Options {
    int64_t row_budget = int64_t{1} << 18;  // rows (ids, bags' ids, input rows) per step per rank
    // Coalescing off, the benchmark baseline: each step runs one request of one rank, the ranks
    // with work taking turns (the others keep theirs queued). Must be the same on every rank.
    bool one_request_per_step = false;
    // Input bytes the queue may hold: Submit refuses a request that would go over it with
    // RESOURCE_EXHAUSTED (an overloaded worker sheds load instead of growing without bound).
    // A request always fits an empty queue.
    int64_t max_queued_bytes = int64_t{1} << 30;
    absl::Duration max_idle_sleep = absl::Milliseconds(1);  // groups that do not park cheaply
    // Ranks park together (StepChannel::Park), so this must be the same on every rank. Groups
    // that park cheaply (StepChannel::ParksCheaply) wait for rounds instead and ignore it.
    int park_after_idle_rounds = 200;  // ~0.2 s of idleness
    // A parked or waiting rank still starts a round this often, so that a peer that died meanwhile
    // is noticed (such a wait does not see a peer's connection close).
    absl::Duration park_check = absl::Seconds(1);
    absl::Duration collective_timeout = absl::Seconds(10);
    InputLimits limits;
    // Called on the loop's thread when the group fails (UNAVAILABLE, with the cause).
    std::function<void(const absl::Status& status)> on_group_broken;
    // Told about every busy step and every request's queue wait (not owned; null: nobody).
    StepObserver* observer = nullptr;
  };

  // `tables` and `sink` must outlive the loop (each request's responder lives until its answer:
  // Responder).
  StepLoop(Options options, LocalKernels& kernels, TableSource& tables, ResponseSink& sink);
  ~StepLoop();  // stops the loop; queued requests fail with UNAVAILABLE

  void Start();
  void Stop();

  // Hands the loop a freshly formed group (replacing any previous one) for `epoch`.
  void SetGroup(StepGroup group, uint64_t epoch);
  // Breaks the current group now, from any thread, when a peer is known to be gone (the
  // coordinator says it is silent): the requests of the step in flight and of the queue get
  // UNAVAILABLE with `reason` at once, new ones are refused, and the loop leaves the group as soon
  // as its wait ends (at once where ranks share memory, at the collective timeout on sockets),
  // then waits for a new group.
  void BreakGroup(const absl::Status& reason);
  uint64_t epoch() const;
  bool serving() const;  // has a group
  // OK while the loop has a group; otherwise UNAVAILABLE saying why not (waiting for all ranks,
  // or why the last group broke).
  absl::Status GroupStatus() const;

  // Queues a prepared request. Refuses it (returns the error; the request is dropped and never
  // answered) with UNAVAILABLE when there is no group, RESOURCE_EXHAUSTED when the queue is full
  // (Options::max_queued_bytes).
  absl::Status Submit(std::unique_ptr<StepRequest> request);

  // Runs `fn` on the loop's thread between steps (so it never races with an op on the shards)
  // and returns once it ran. Runs it on the calling thread when the loop has stopped.
  void RunBetweenSteps(const std::function<void()>& fn);
  // From a task RunBetweenSteps runs: waits until every log record handed to the syncer is
  // written, so that the task may replace a table's update log.
  void WaitForLogWrites();

  // Steps run so far that carried work, and agreement rounds (busy or idle), for tests and
  // metrics.
  int64_t busy_steps() const;
  int64_t rounds() const { return rounds_.load(); }
  // Requests queued for a step now, and their input bytes (for metrics).
  std::pair<int64_t, int64_t> queued() const;

 private:
  // The state of a group and of one iteration (step_loop_state.h).
  struct Group;
  struct Step;

  void Run();
  // The phases of one iteration of Run(), in order.
  bool TakeNews(Group& group, Step& step);  // false: stop
  void AnswerStale(Step& step);
  bool WaitForRound(Group& group, Step& step);  // false: no round now (news came instead)
  void Agree(Group& group, Step& step);
  void TakeTurn(Group& group, Step& step);
  bool Idle(Group& group, Step& step);  // true: on to the next iteration
  // The agreed work (step_loop_work.cc).
  void RunOps(Group& group, Step& step);
  void RunWork(Group& group, Step& step, ShardedOps& ops);
  // Updates' way through a step (step_loop_updates.cc).
  void RunUpdates(Group& group, Step& step, const WorkKey& key,
                  std::vector<absl::Span<const char>>& inputs,
                  const std::shared_ptr<ShardedTable>& table);
  void StartSync(Group& group, Step& step);
  void Acknowledge(Group& group, Step& step);
  void FailPendingAcks(Group& group, const absl::Status& status);
  void FailGroup(Group& group, Step& step);

  // Answers `request` unless BreakGroup did, and frees it.
  void Answer(std::unique_ptr<StepRequest>& request, absl::StatusOr<DenseResult> answer);
  // The step's requests, which BreakGroup may answer while the loop waits (none: `batch` empty).
  void SetInFlight(const std::vector<std::unique_ptr<StepRequest>>& batch);

  absl::Status GroupStatusLocked() const ABSL_SHARED_LOCKS_REQUIRED(mu_);
  // Wakes the loop if it is parked or waiting (news for it: work, a group, a task, Stop).
  void UnparkLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  LocalKernels& kernels_;
  TableSource& tables_;
  ResponseSink& sink_;
  std::thread thread_;
  std::thread park_checker_;  // unparks the loop every Options::park_check
  std::unique_ptr<LogSyncer> syncer_;  // the update logs' writes and syncs

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool sync_news_ ABSL_GUARDED_BY(mu_) = false;  // the syncer synced more: peers should hear
  std::deque<std::unique_ptr<StepRequest>> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // InputBytes() of queue_
  StepGroup pending_group_ ABSL_GUARDED_BY(mu_);
  uint64_t pending_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  StepGroup active_group_ ABSL_GUARDED_BY(mu_);  // the loop's; woken and broken from outside
  // Has a group. Written under mu_; read without it too (per-request checks).
  std::atomic<bool> serving_{false};
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::deque<std::function<void()>> between_steps_ ABSL_GUARDED_BY(mu_);
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  int64_t busy_steps_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int64_t> rounds_{0};
  // BreakGroup's reason, for the loop to leave the group at its next chance (OK: none), and why
  // the last group broke (for GroupStatus).
  absl::Status break_requested_ ABSL_GUARDED_BY(mu_);
  absl::Status last_break_ ABSL_GUARDED_BY(mu_);
  // The step in flight's requests (taken after mu_ when both are held).
  absl::Mutex answer_mu_ ABSL_ACQUIRED_AFTER(mu_);
  std::vector<StepRequest*> in_flight_ ABSL_GUARDED_BY(answer_mu_);
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_STEP_STEP_LOOP_H_
