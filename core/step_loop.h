// StepLoop: a worker's executor. It owns the group's Communicator and runs the step loop of
// DESIGN.md: each iteration the ranks all-gather which (table, op) work they have queued, with
// their concatenated input for each (the agreement round); if any rank has work, every rank runs
// each sharded op in the agreed order with whatever it has queued for it (possibly empty; the ops
// take the inputs the round carried instead of gathering them again), and answers its own callers.
// The round also carries a digest of each rank's tables; in the rare step whose ranks hold
// different ones (see SetTable), one more round tells them which work none may run. A new group's
// first round is a hello in which the ranks check that they speak the same step protocol (run the
// same build); if not, the group fails with an error that says so.
// A group whose communicator wakes cheaply (ranks that share memory ring each other's doorbells)
// runs no idle rounds of its own accord: a rank without work waits (Communicator::AwaitRound)
// until a peer starts the next round or it has news itself - a request, a new group, a task
// between steps, Stop, or the periodic check (Options::park_check, on each rank) that finds peers
// gone - and news other than a request makes it run a round without work. Other idle groups back
// off (sleep up to Options::max_idle_sleep between rounds) instead of spinning, and after
// Options::park_after_idle_rounds idle rounds park (Communicator::Park: no rounds, no polling)
// until any rank has news or the periodic check.
//
// Thread-safety: Submit, SetGroup, SetTable, DropTable, RunBetweenSteps and Stop may be called
// from any thread;
// everything else runs on the loop's own thread, which calls LocalKernels::InitThread() first.
// Requests are answered exactly once, on the loop thread (or at once, on Submit's thread, when
// refused). A failed collective fails the step's requests with UNAVAILABLE, drops the group and
// reports it through Options::on_group_broken (with the tables it may have left renormed unlike
// on the other ranks, which it drops too); the loop then waits for SetGroup.
#ifndef SHARDSERVE_CORE_STEP_LOOP_H_
#define SHARDSERVE_CORE_STEP_LOOP_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/communicator.h"
#include "core/local_kernels.h"
#include "core/op_inputs.h"
#include "core/sharded_table.h"

namespace shardserve::core {

// One caller's request, validated and owning its data, waiting for a step.
struct StepRequest {
  enum class Op { kEmbedding, kEmbeddingBag, kLinear };
  Op op = Op::kEmbedding;
  std::string table;
  std::vector<int64_t> shape;    // ids' (embedding, bag) or the input's (linear) shape
  std::vector<int64_t> ids;      // embedding, bag
  std::vector<int64_t> offsets;  // bag: canonical, num_bags + 1 entries
  std::vector<float> weights;    // bag: per-sample weights, or empty
  bool has_weights = false;
  PoolMode mode = PoolMode::kMean;
  std::vector<float> values;     // linear input rows
  absl::Time deadline = absl::InfiniteFuture();
  std::function<void(absl::StatusOr<DenseResult>)> done;

  // Rows this request adds to a step (ids, bags' ids, or input rows), for the row budget.
  int64_t Rows() const;
  // Bytes of input it holds while queued, for Options::max_queued_bytes.
  int64_t InputBytes() const;
};

// Validates a request against its table and puts it in canonical form (bag offsets). Returns the
// request ready for Submit, or INVALID_ARGUMENT / RESOURCE_EXHAUSTED.
absl::Status PrepareRequest(const TableConfig& table, const InputLimits& limits,
                            StepRequest& request, absl::Span<const int64_t> raw_offsets,
                            bool has_offsets, bool include_last_offset);

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
    // Ranks park together (Communicator::Park), so this must be the same on every rank. Groups
    // that park cheaply (Communicator::ParksCheaply) wait for rounds instead and ignore it.
    int park_after_idle_rounds = 200;  // ~0.2 s of idleness (see Communicator::Park)
    // A parked or waiting rank still starts a round this often, so that a peer that died meanwhile
    // is noticed (such a wait does not see a peer's connection close).
    absl::Duration park_check = absl::Seconds(1);
    absl::Duration collective_timeout = absl::Seconds(10);
    InputLimits limits;
    // Called on the loop's thread when the group fails. `renorm_unsure` holds the tables whose
    // rows this rank may now hold renormed unlike its peers: the step failed during a lookup of a
    // column-sharded max_norm table, so the collective that renorms its rows may have completed
    // on some ranks only. The loop has dropped them (unless SetTable replaced them meanwhile);
    // every rank must load them again.
    std::function<void(const absl::Status& status,
                       const std::vector<std::shared_ptr<ShardedTable>>& renorm_unsure)>
        on_group_broken;
    // Called on the loop's thread once the answers it gave may go out together: after each round
    // (a step's answers go out when the whole step is done) and before the loop waits on its
    // peers after answering expired requests. A server may hold the answers given on the loop's
    // thread (OnLoopThread) and send them here.
    std::function<void()> after_answers;
  };

  StepLoop(Options options, LocalKernels& kernels);
  ~StepLoop();  // stops the loop; queued requests fail with UNAVAILABLE

  void Start();
  void Stop();

  // Hands the loop a freshly formed group (replacing any previous one) for `epoch`. `control`
  // carries inputs and agreement rounds (host memory); `data`, when given, carries results in the
  // kernels' memory (e.g. NCCL for GPU kernels) - otherwise `control` does both.
  void SetGroup(std::unique_ptr<Communicator> control, uint64_t epoch,
                std::unique_ptr<Communicator> data = nullptr);
  uint64_t epoch() const;
  bool serving() const;  // has a group

  // Tables this rank holds. Requests name tables by name. While a table is being created,
  // replaced or dropped, the ranks' sets differ for a moment: a queued request for a table this
  // rank has dropped since is answered NOT_FOUND, and work for a table that the ranks do not all
  // hold alike (same name, config and source of the weights) is answered UNAVAILABLE on every
  // rank, while the group goes on serving the other tables.
  void SetTable(std::shared_ptr<ShardedTable> table);
  void DropTable(const std::string& name);

  // Queues a prepared request. Refuses (answers at once) with UNAVAILABLE when there is no group,
  // RESOURCE_EXHAUSTED when the queue is full (Options::max_queued_bytes).
  void Submit(std::unique_ptr<StepRequest> request);

  // Runs `fn` on the loop's thread between steps (so it never races with an op on the shards)
  // and returns once it ran. Runs it on the calling thread when the loop has stopped.
  void RunBetweenSteps(const std::function<void()>& fn);

  // Steps run so far that carried work, and agreement rounds (busy or idle) (for tests and
  // metrics).
  int64_t busy_steps() const;
  int64_t rounds() const { return rounds_.load(); }

  // Whether the calling thread is the loop's own.
  bool OnLoopThread() const { return std::this_thread::get_id() == loop_thread_id_.load(); }

 private:
  // The tables this rank holds, replaced whole on each change: a step runs on the set it started
  // with.
  struct TableSet {
    std::map<std::string, std::shared_ptr<ShardedTable>> tables;
    // Of every table's name and config: equal on ranks that hold the same tables.
    uint64_t digest = 0;
  };

  void Run();
  void FailAll(std::vector<std::unique_ptr<StepRequest>>& batch, const absl::Status& status);
  void SetTablesLocked(std::map<std::string, std::shared_ptr<ShardedTable>> tables)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Wakes the loop if it is parked (news for it: work, a group, a task, Stop).
  void UnparkLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  LocalKernels& kernels_;
  std::thread thread_;
  std::atomic<std::thread::id> loop_thread_id_{};
  std::thread park_checker_;  // unparks the loop every Options::park_check

  mutable absl::Mutex mu_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<std::unique_ptr<StepRequest>> queue_ ABSL_GUARDED_BY(mu_);
  int64_t queued_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // InputBytes() of queue_
  std::unique_ptr<Communicator> pending_comm_ ABSL_GUARDED_BY(mu_);
  Communicator* active_comm_ ABSL_GUARDED_BY(mu_) = nullptr;  // the loop's; Unpark()ed on news
  std::unique_ptr<Communicator> pending_data_ ABSL_GUARDED_BY(mu_);
  uint64_t pending_epoch_ ABSL_GUARDED_BY(mu_) = 0;
  // Has a group. Written under mu_; read without it too (per-request checks).
  std::atomic<bool> serving_{false};
  uint64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  std::shared_ptr<const TableSet> tables_ ABSL_GUARDED_BY(mu_);
  std::deque<std::function<void()>> between_steps_ ABSL_GUARDED_BY(mu_);
  bool running_ ABSL_GUARDED_BY(mu_) = false;
  int64_t busy_steps_ ABSL_GUARDED_BY(mu_) = 0;
  std::atomic<int64_t> rounds_{0};
};

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_STEP_LOOP_H_
