#include "core/step/step_loop.h"

#include <algorithm>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/base/process_setup.h"
#include "core/step/log_syncer.h"
#include "core/step/step_loop_state.h"
#include "core/step/step_protocol.h"
#include "core/table/update_log.h"

namespace shardserve::core {

StepLoop::StepLoop(Options options, LocalKernels& kernels, TableSource& tables,
                   ResponseSink& sink)
    : options_(std::move(options)), kernels_(kernels), tables_(tables), sink_(sink) {}

StepLoop::~StepLoop() { Stop(); }

void StepLoop::UnparkLocked() {
  if (active_group_.channel != nullptr) active_group_.channel->Unpark();
}

void StepLoop::Start() {
  syncer_ = std::make_unique<LogSyncer>([this] {
    absl::MutexLock lock(&mu_);
    sync_news_ = true;
    UnparkLocked();
  });
  {
    absl::MutexLock lock(&mu_);
    running_ = true;
  }
  thread_ = std::thread([this] {
    NameThread("step_loop");
    Run();
  });
  park_checker_ = std::thread([this] {
    NameThread("park_check");
    absl::MutexLock lock(&mu_);
    while (!mu_.AwaitWithTimeout(absl::Condition(&stop_), options_.park_check)) {
      UnparkLocked();
    }
  });
}

void StepLoop::RunBetweenSteps(const std::function<void()>& fn) {
  bool done = false;
  {
    absl::MutexLock lock(&mu_);
    if (running_ && !stop_) {
      between_steps_.push_back([&] {
        fn();
        absl::MutexLock done_lock(&mu_);
        done = true;
      });
      UnparkLocked();
      mu_.Await(absl::Condition(&done));
      return;
    }
  }
  fn();  // the loop is not running: nothing else touches the shards
}

void StepLoop::WaitForLogWrites() { syncer_->WaitUntilIdle(); }

void StepLoop::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    UnparkLocked();
  }
  if (thread_.joinable()) thread_.join();
  if (park_checker_.joinable()) park_checker_.join();
  syncer_.reset();  // after the loop: it waits for what it was given
  std::deque<std::unique_ptr<StepRequest>> left;
  std::deque<std::function<void()>> tasks;
  {
    absl::MutexLock lock(&mu_);
    running_ = false;
    left.swap(queue_);
    queued_bytes_ = 0;
    tasks.swap(between_steps_);
  }
  for (auto& task : tasks) task();  // callers are waiting for them
  for (auto& r : left) {
    r->responder->Answer(*r, absl::UnavailableError("worker is shutting down"));
  }
  if (!left.empty()) sink_.Flush();
}

void StepLoop::SetGroup(StepGroup group, uint64_t epoch) {
  absl::MutexLock lock(&mu_);
  pending_group_ = std::move(group);
  pending_epoch_ = epoch;
  UnparkLocked();
}

void StepLoop::BreakGroup(const absl::Status& reason) {
  std::deque<std::unique_ptr<StepRequest>> queued;
  uint64_t epoch = 0;
  {
    absl::MutexLock lock(&mu_);
    if (active_group_.channel == nullptr || !serving_) return;
    break_requested_ = reason;
    serving_ = false;  // Submit refuses from now on
    epoch = epoch_;
    queued.swap(queue_);
    queued_bytes_ = 0;
    active_group_.channel->Interrupt();  // a wait on a peer ends at once, where it can
    UnparkLocked();                      // and an idle wait for a round
  }
  const absl::Status status = absl::UnavailableError(
      absl::StrCat("group epoch ", epoch, " failed: ", reason.message()));
  {
    absl::MutexLock lock(&answer_mu_);
    for (StepRequest* r : in_flight_) {
      if (r->answered) continue;
      r->answered = true;
      r->responder->Answer(*r, status);
    }
  }
  for (auto& r : queued) r->responder->Answer(*r, status);
  sink_.Flush();
}

absl::Status StepLoop::GroupStatus() const {
  absl::MutexLock lock(&mu_);
  return GroupStatusLocked();
}

absl::Status StepLoop::GroupStatusLocked() const {
  if (serving_) return absl::OkStatus();
  if (!break_requested_.ok() || !last_break_.ok()) {
    const absl::Status& why = !break_requested_.ok() ? break_requested_ : last_break_;
    return absl::UnavailableError(absl::StrCat(
        "group not formed: ", why.message(), "; waiting for the group to form again"));
  }
  return absl::UnavailableError(
      "group not formed: this worker's group is waiting for all its ranks");
}

uint64_t StepLoop::epoch() const {
  absl::MutexLock lock(&mu_);
  return serving_ ? epoch_ : 0;
}

bool StepLoop::serving() const { return serving_.load(std::memory_order_relaxed); }

std::pair<int64_t, int64_t> StepLoop::queued() const {
  absl::MutexLock lock(&mu_);
  return {static_cast<int64_t>(queue_.size()), queued_bytes_};
}

int64_t StepLoop::busy_steps() const {
  absl::MutexLock lock(&mu_);
  return busy_steps_;
}

absl::Status StepLoop::Submit(std::unique_ptr<StepRequest> request) {
  absl::MutexLock lock(&mu_);
  const int64_t bytes = request->InputBytes();
  if (stop_ || (!serving_ && pending_group_.channel == nullptr)) {
    return stop_ ? absl::UnavailableError("worker is shutting down") : GroupStatusLocked();
  }
  if (!queue_.empty() && queued_bytes_ + bytes > options_.max_queued_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "worker overloaded: ", queue_.size(), " requests (", queued_bytes_,
        " bytes of input) are queued, the limit is ", options_.max_queued_bytes,
        " bytes; retry later"));
  }
  queued_bytes_ += bytes;
  queue_.push_back(std::move(request));
  UnparkLocked();
  return absl::OkStatus();
}

void StepLoop::Run() {
  kernels_.InitThread();
  Group group;
  while (true) {
    sink_.Flush();  // the last round's answers
    Step step;
    // BreakGroup may answer the step's requests until the step is done with them.
    struct InFlight {
      ~InFlight() { loop->SetInFlight({}); }
      StepLoop* loop;
    } in_flight{this};
    if (!TakeNews(group, step)) break;
    AnswerStale(step);
    if (!WaitForRound(group, step)) continue;
    if (options_.observer) step.round_start = absl::Now();
    if (step.broken.ok()) Agree(group, step);
    if (step.broken.ok()) Acknowledge(group, step);
    if (step.broken.ok() && options_.one_request_per_step) TakeTurn(group, step);
    if (step.broken.ok() && step.agreement->work().empty() && Idle(group, step)) continue;
    group.idle = absl::ZeroDuration();
    group.idle_rounds = 0;
    if (options_.observer) step.agreement_time = absl::Now() - step.round_start;
    if (step.broken.ok()) RunOps(group, step);
    if (!step.broken.ok()) FailGroup(group, step);
  }
  FailPendingAcks(group, absl::UnavailableError("worker is shutting down"));
  {
    absl::MutexLock lock(&mu_);
    active_group_ = StepGroup();
  }
  sink_.Flush();
}

// Waits for a group (or Stop), runs the tasks due between steps, takes in a new group, and takes
// this step's requests off the queue (up to the row budget).
bool StepLoop::TakeNews(Group& group, Step& step) {
  {
    absl::MutexLock lock(&mu_);
    while (true) {
      auto ready = [this, &group]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stop_ || pending_group_.channel != nullptr || group.formed() ||
               !between_steps_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_) return false;
      while (!between_steps_.empty()) {
        std::function<void()> task = std::move(between_steps_.front());
        between_steps_.pop_front();
        mu_.Unlock();
        task();
        mu_.Lock();
      }
      if (group.formed() || pending_group_.channel != nullptr) break;
    }
    if (sync_news_ && group.formed()) group.round_due = true;  // tell the peers how far it synced
    sync_news_ = false;
    if (pending_group_.channel != nullptr) {
      if (!group.acks.empty()) {
        mu_.Unlock();
        FailPendingAcks(group,
                        absl::UnavailableError(
                            "the group was formed anew before every rank synced the update"));
        mu_.Lock();
      }
      group = Group();  // the previous group's transports close here
      group.transports = std::move(pending_group_);
      if (options_.observer != nullptr) {
        group.timed_control = std::make_shared<TimedCollectives>(group.transports.control);
        group.timed_data = group.transports.data == group.transports.control
                               ? group.timed_control
                               : std::make_shared<TimedCollectives>(group.transports.data);
      }
      pending_group_ = StepGroup();
      group.hello_due = true;
      active_group_ = group.transports;
      epoch_ = pending_epoch_;
      serving_ = true;
      break_requested_ = absl::OkStatus();
    }
    // BreakGroup was called: leave the group now (the queue was failed then).
    if (!break_requested_.ok()) step.broken = break_requested_;
    // News from here on (Submit's Unpark) is what a wait before the next round waits for.
    if (!group.round_due) group.transports.channel->ClearUnpark();
    int64_t rows = 0;
    while (!queue_.empty() &&
           (step.batch.empty() || (!options_.one_request_per_step &&
                                   rows + queue_.front()->Rows() <= options_.row_budget))) {
      rows += queue_.front()->Rows();
      queued_bytes_ -= queue_.front()->InputBytes();
      step.batch.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
  }
  SetInFlight(step.batch);
  step.tables = tables_.Tables();
  return true;
}

void StepLoop::SetInFlight(const std::vector<std::unique_ptr<StepRequest>>& batch) {
  absl::MutexLock lock(&answer_mu_);
  in_flight_.clear();
  for (const auto& r : batch) in_flight_.push_back(r.get());
}

void StepLoop::Answer(std::unique_ptr<StepRequest>& request,
                      absl::StatusOr<DenseResult> answer) {
  {
    absl::MutexLock lock(&answer_mu_);
    const bool delivered = request->answered;
    request->answered = true;
    if (delivered) {  // by BreakGroup: the loop's own answer is late
      request.reset();
      return;
    }
  }
  request->responder->Answer(*request, std::move(answer));
  request.reset();
}

// Answers the requests whose deadline passed in the queue, or whose table was dropped meanwhile.
void StepLoop::AnswerStale(Step& step) {
  const absl::Time now = absl::Now();
  bool answered = false;
  for (auto& r : step.batch) {
    absl::Status stale;
    if (r->deadline < now) {
      stale = absl::DeadlineExceededError("deadline passed in queue");
    } else if (step.tables->tables.count(r->table) == 0) {
      stale = absl::NotFoundError(
          absl::StrCat("table \"", r->table, "\" was dropped while the request waited"));
    } else {
      continue;
    }
    Answer(r, stale);
    answered = true;
  }
  if (!answered) return;
  step.batch.erase(std::remove(step.batch.begin(), step.batch.end(), nullptr), step.batch.end());
  SetInFlight(step.batch);
  sink_.Flush();  // their answers, before any wait
}

// A rank without work in a group that parks cheaply waits until a peer starts the next round,
// or news (a request, a task, a new group, Stop, the periodic check) comes; then the loop takes
// the news in first. Returns whether a round is to run now.
bool StepLoop::WaitForRound(Group& group, Step& step) {
  if (!step.broken.ok()) return true;  // on to failing the group
  if (group.round_due || group.hello_due || !step.batch.empty() ||
      !group.transports.channel->ParksCheaply()) {
    group.round_due = false;
    return true;
  }
  step.tables.reset();
  step.loads.clear();
  absl::Status waited = group.transports.channel->AwaitRound();
  if (waited.ok()) {
    group.round_due = true;
    return false;
  }
  step.broken = waited;
  step.tables = tables_.Tables();
  return true;
}

// The agreement round (after a new group's hello): every rank learns which (table, op) work any
// rank has, and with it every rank's input for that work.
void StepLoop::Agree(Group& group, Step& step) {
  for (size_t i = 0; i < step.batch.size(); ++i) {
    step.mine[WorkKey::Of(*step.batch[i])].push_back(i);
  }
  StepChannel& channel = *group.transports.channel;
  if (group.hello_due) {
    group.hello_due = false;
    absl::StatusOr<std::vector<absl::Span<const char>>> hellos = channel.AllGatherMessages(
        AsBytes(HelloMessage(options_.one_request_per_step)), options_.collective_timeout);
    step.broken = hellos.ok() ? CheckHellos(*hellos, options_.one_request_per_step)
                              : hellos.status();
    if (!step.broken.ok()) return;
  }
  const int64_t round = ++group.round;
  AgreementWriter writer(step.tables->digest, syncer_->Synced(round - 1));
  for (const auto& [key, indices] : step.mine) writer.Add(key, step.Requests(indices));
  rounds_.fetch_add(1);
  absl::StatusOr<std::vector<absl::Span<const char>>> messages =
      channel.AllGatherMessages(writer.bytes(), options_.collective_timeout);
  if (!messages.ok()) {
    step.broken = messages.status();
    return;
  }
  absl::StatusOr<Agreement> agreement = Agreement::Read(*messages);
  if (!agreement.ok()) {
    step.broken = agreement.status();
    return;
  }
  step.agreement = *std::move(agreement);
}

// One request per step: every rank sees the same rounds, so every rank picks the same rank's
// request; the others' requests go back to the front of their queues.
void StepLoop::TakeTurn(Group& group, Step& step) {
  Agreement& agreement = *step.agreement;
  auto& work = agreement.work();
  if (work.empty()) return;
  const int world = agreement.world();
  for (int i = 1; i <= world; ++i) {
    if (agreement.has_work((group.turn + i) % world)) {
      group.turn = (group.turn + i) % world;
      break;
    }
  }
  for (auto it = work.begin(); it != work.end();) {
    for (int q = 0; q < world; ++q) {
      if (q != group.turn) it->second[q] = {};
    }
    it = it->second[group.turn].data() == nullptr ? work.erase(it) : std::next(it);
  }
  if (group.transports.channel->rank() == group.turn || step.batch.empty()) return;
  step.mine.clear();
  absl::MutexLock lock(&mu_);
  absl::MutexLock answers(&answer_mu_);
  for (auto r = step.batch.rbegin(); r != step.batch.rend(); ++r) {
    if ((*r)->answered) continue;  // by BreakGroup
    queued_bytes_ += (*r)->InputBytes();
    queue_.push_front(std::move(*r));
  }
  step.batch.clear();
  in_flight_.clear();
}

// No rank had work. A group that parks cheaply goes back to waiting for the next round
// (AwaitRound). Otherwise back off (each rank sleeps between rounds, waking at once for local
// work); after park_after_idle_rounds such rounds (the same round on every rank) park the group
// until any rank has news - work, a new group, a task, Stop. Waking a group parked on sockets
// costs more than a round, so there traffic with short gaps never parks it. Returns whether the
// loop goes on to its next iteration (false: the park failed, step.broken says why).
bool StepLoop::Idle(Group& group, Step& step) {
  step.tables.reset();
  step.loads.clear();
  StepChannel& channel = *group.transports.channel;
  if (channel.ParksCheaply()) return true;
  const bool syncing = !group.acks.empty() || !syncer_->Idle();  // peers wait to hear of it
  if (++group.idle_rounds > options_.park_after_idle_rounds && !syncing) {
    absl::Status parked = channel.Park(options_.collective_timeout);
    if (parked.ok()) return true;
    if (!absl::IsUnimplemented(parked)) {  // cannot park: back off instead
      step.broken = parked;
      return false;
    }
  }
  group.idle = std::min(std::max(group.idle * 2, absl::Microseconds(50)), options_.max_idle_sleep);
  absl::MutexLock lock(&mu_);
  auto wake = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return stop_ || !queue_.empty() || pending_group_.channel != nullptr ||
           !between_steps_.empty() || sync_news_;
  };
  mu_.AwaitWithTimeout(absl::Condition(&wake), group.idle);
  return true;
}

// The group failed: this step's requests and the queue get UNAVAILABLE, the group is dropped
// (Submit refuses from now on), and tables the step may have left renormed unlike on the peers
// go back to the table source.
void StepLoop::FailGroup(Group& group, Step& step) {
  const absl::Status status = absl::UnavailableError(
      absl::StrCat("group epoch ", epoch(), " failed: ", step.broken.message()));
  for (auto& r : step.batch) {
    if (r != nullptr) Answer(r, status);
  }
  step.batch.clear();
  for (const std::shared_ptr<ShardedTable>& table : step.loads) {
    if (table->log() != nullptr) table->log()->Discard();  // never written: never acknowledged
  }
  syncer_->WaitUntilIdle();  // nothing writes the logs of the tables handed back below
  {
    absl::MutexLock lock(&mu_);
    active_group_ = StepGroup();
    last_break_ = status;
  }
  FailPendingAcks(group, status);
  group = Group();
  std::deque<std::unique_ptr<StepRequest>> queued;
  {
    absl::MutexLock lock(&mu_);
    serving_ = false;  // from now on Submit refuses at once
    queued.swap(queue_);
    queued_bytes_ = 0;
  }
  for (auto& r : queued) r->responder->Answer(*r, status);
  step.tables.reset();
  step.loads.clear();
  for (const std::shared_ptr<ShardedTable>& table : step.renorm_unsure) {
    tables_.DropRenormUnsure(table);
  }
  if (options_.on_group_broken) options_.on_group_broken(status);
}

}  // namespace shardserve::core
