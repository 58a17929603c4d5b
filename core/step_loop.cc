#include "core/step_loop.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/sharded_ops.h"
#include "core/status_macros.h"

namespace shardserve::core {
namespace {

// Requests that can share one sharded op call: same table, op, mode and weights-or-not. The key
// travels in the agreement round; the table name comes last so it may contain any character.
std::string KeyOf(const StepRequest& r) {
  return absl::StrCat(static_cast<int>(r.op), "|", static_cast<int>(r.mode), "|",
                      r.has_weights ? 1 : 0, "|", r.table);
}

struct Key {
  StepRequest::Op op;
  PoolMode mode;
  bool has_weights;
  std::string table;
};

absl::StatusOr<Key> ParseKey(absl::string_view text) {
  std::vector<absl::string_view> parts = absl::StrSplit(text, absl::MaxSplits('|', 3));
  int op = 0, mode = 0, weights = 0;
  if (parts.size() != 4 || !absl::SimpleAtoi(parts[0], &op) || !absl::SimpleAtoi(parts[1], &mode) ||
      !absl::SimpleAtoi(parts[2], &weights) || op < 0 || op > 2 || mode < 0 || mode > 2) {
    return absl::InternalError(absl::StrCat("step: bad work key \"", text, "\""));
  }
  return Key{static_cast<StepRequest::Op>(op), static_cast<PoolMode>(mode), weights == 1,
             std::string(parts[3])};
}

// One (table, op) key's work on this rank in a step: its requests, concatenated into one input.
struct KeyWork {
  std::vector<StepRequest*> reqs;
  std::vector<int64_t> ids, offsets = {0};
  std::vector<float> weights, values;
  // The table its input was encoded against: the op runs on the same one, even if the table is
  // replaced meanwhile (its input message must match what the peers were sent).
  std::shared_ptr<ShardedTable> table;
};

// Calls fn with `w` as the op's input for `key` (table width `in_features` for linear).
template <typename Fn>
auto WithInput(const Key& key, const KeyWork& w, int64_t in_features, Fn&& fn) {
  switch (key.op) {
    case StepRequest::Op::kEmbedding:
      return fn(EmbeddingInput{w.ids, {static_cast<int64_t>(w.ids.size())}});
    case StepRequest::Op::kEmbeddingBag: {
      EmbeddingBagInput in;
      in.ids = w.ids;
      in.shape = {static_cast<int64_t>(w.ids.size())};
      in.offsets = absl::MakeConstSpan(w.offsets);
      in.include_last_offset = true;
      if (key.has_weights) in.per_sample_weights = absl::MakeConstSpan(w.weights);
      in.mode = key.mode;
      return fn(in);
    }
    case StepRequest::Op::kLinear:
    default:
      return fn(LinearInput{w.values, {static_cast<int64_t>(w.values.size()) / in_features,
                                       in_features}});
  }
}

absl::StatusOr<DenseResult> RunOp(ShardedOps& ops, ShardedTable& table, const EmbeddingInput& in,
                                  const ShardedOps::InputMessages* gathered) {
  return ops.Embedding(table, in, gathered);
}
absl::StatusOr<DenseResult> RunOp(ShardedOps& ops, ShardedTable& table,
                                  const EmbeddingBagInput& in,
                                  const ShardedOps::InputMessages* gathered) {
  return ops.EmbeddingBag(table, in, gathered);
}
absl::StatusOr<DenseResult> RunOp(ShardedOps& ops, ShardedTable& table, const LinearInput& in,
                                  const ShardedOps::InputMessages* gathered) {
  return ops.Linear(table, in, gathered);
}

// The agreement message: for each key this rank has work for, [key bytes][message bytes] (two
// int64s), the key padded to whole int64s, then its input message (int64 words: ops read it so).
void AppendEntry(std::vector<int64_t>& out, const std::string& key,
                 const std::vector<int64_t>& message) {
  out.push_back(static_cast<int64_t>(key.size()));
  out.push_back(static_cast<int64_t>(message.size() * sizeof(int64_t)));
  const size_t at = out.size();
  out.resize(at + (key.size() + 7) / 8, 0);
  std::memcpy(out.data() + at, key.data(), key.size());
  out.insert(out.end(), message.begin(), message.end());
}

// Parses entries written by AppendEntry (copied into `words`) into key -> message.
absl::Status ParseEntries(absl::Span<const int64_t> words,
                          std::map<std::string, absl::Span<const char>>& entries) {
  size_t at = 0;
  while (at < words.size()) {
    if (at + 2 > words.size() || words[at] < 0 || words[at + 1] < 0) {
      return absl::InternalError("step: bad agreement message");
    }
    const size_t key_words = (static_cast<size_t>(words[at]) + 7) / 8;
    const size_t message_words = (static_cast<size_t>(words[at + 1]) + 7) / 8;
    if (at + 2 + key_words + message_words > words.size()) {
      return absl::InternalError("step: bad agreement message");
    }
    const char* base = reinterpret_cast<const char*>(words.data() + at + 2);
    entries[std::string(base, words[at])] =
        absl::Span<const char>(base + key_words * 8, words[at + 1]);
    at += 2 + key_words + message_words;
  }
  return absl::OkStatus();
}

// The first round of every group: each rank says which step protocol it speaks (the format of
// the agreement message and the collectives of the ops) and how it forms steps, so that ranks
// running different builds or settings fail the group with an error that says so instead of
// misreading each other's rounds. It starts with two int64 words that stay as they are:
// kHelloMagic, then kStepProtocol (older builds have no hello: their first round is an agreement
// message); since protocol 3 a third word follows, the step mode (1: one request per step).
// Bump kStepProtocol on any change to the agreement message, the ops' collectives or the framing
// of the communicator's messages.
constexpr int64_t kHelloMagic = 0x70657473'64726168;  // "hardstep" in little-endian bytes
constexpr int64_t kStepProtocol = 3;

absl::Status SayHello(Communicator& comm, bool one_request_per_step, absl::Duration timeout) {
  const int64_t mode = one_request_per_step ? 1 : 0;
  const int64_t hello[] = {kHelloMagic, kStepProtocol, mode};
  SHARDSERVE_ASSIGN_OR_RETURN(
      std::vector<absl::Span<const char>> views,
      comm.AllGatherMessages(
          absl::MakeConstSpan(reinterpret_cast<const char*>(hello), sizeof(hello)), timeout));
  for (size_t q = 0; q < views.size(); ++q) {
    int64_t theirs[3] = {0, 0, 0};
    if (views[q].size() == sizeof(theirs)) std::memcpy(theirs, views[q].data(), sizeof(theirs));
    if (views[q].size() == 2 * sizeof(int64_t)) std::memcpy(theirs, views[q].data(), 16);
    if (theirs[0] != kHelloMagic || theirs[1] != kStepProtocol) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", q,
          theirs[0] == kHelloMagic ? absl::StrCat(" speaks step protocol ", theirs[1])
                                   : std::string(" speaks an older step protocol"),
          ", this rank ", kStepProtocol,
          ": every rank of a group must run the same shardserve build"));
    }
    if (theirs[2] != mode) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank ", q, " runs with one_request_per_step ", theirs[2] == 1 ? "on" : "off",
          ", this rank ", one_request_per_step ? "on" : "off",
          ": every rank of a group must form steps alike (--one_request_per_step)"));
    }
  }
  return absl::OkStatus();
}

// FNV-1a: the same in every process (absl::Hash is seeded per process).
uint64_t Fnv1a(absl::string_view bytes, uint64_t h = 14695981039346656037ull) {
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// What ranks must agree on to run a table's ops together: its name and its whole config.
int64_t IdentityOf(const TableConfig& c) {
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

void Answer(StepRequest& r, absl::StatusOr<DenseResult> result) {
  if (!r.done) return;
  auto done = std::move(r.done);
  r.done = nullptr;
  done(std::move(result));
}

// Copies a gathered message out of the communicator's buffers (which its next round reuses) as
// int64 words.
absl::Status CopyWords(absl::Span<const char> view, std::vector<int64_t>& words) {
  if (view.size() % 8 != 0) return absl::InternalError("step: bad agreement message");
  words.resize(view.size() / 8);
  if (!view.empty()) std::memcpy(words.data(), view.data(), view.size());
  return absl::OkStatus();
}

// For a step whose ranks hold different table sets (a table being created, replaced or dropped):
// the ranks tell each other which tables they hold, and work for a table that not every rank
// holds alike (same name, config and source) is taken out of `work` and its requests answered
// UNAVAILABLE - on every rank, since all decide from the same messages.
absl::Status SkipTablesNotHeldAlike(
    Communicator& comm, const std::map<std::string, std::shared_ptr<ShardedTable>>& tables,
    absl::Duration timeout, std::map<std::string, std::vector<absl::Span<const char>>>& work,
    std::map<std::string, KeyWork>& mine) {
  std::vector<int64_t> held;
  for (const auto& [name, table] : tables) AppendEntry(held, name, {IdentityOf(table->config())});
  SHARDSERVE_ASSIGN_OR_RETURN(
      std::vector<absl::Span<const char>> views,
      comm.AllGatherMessages(absl::MakeConstSpan(reinterpret_cast<const char*>(held.data()),
                                                 held.size() * sizeof(int64_t)),
                             timeout));
  std::vector<std::map<std::string, int64_t>> identities(views.size());  // per rank, by name
  std::vector<int64_t> words;
  for (size_t q = 0; q < views.size(); ++q) {
    SHARDSERVE_RETURN_IF_ERROR(CopyWords(views[q], words));
    std::map<std::string, absl::Span<const char>> entries;
    SHARDSERVE_RETURN_IF_ERROR(ParseEntries(words, entries));
    for (const auto& [name, identity] : entries) {
      if (identity.size() != sizeof(int64_t)) return absl::InternalError("step: bad table list");
      std::memcpy(&identities[q][name], identity.data(), sizeof(int64_t));
    }
  }
  for (auto it = work.begin(); it != work.end();) {
    SHARDSERVE_ASSIGN_OR_RETURN(Key key, ParseKey(it->first));
    std::optional<int64_t> first;  // rank 0's identity of the table, if it holds it
    bool alike = true;
    for (const auto& of_rank : identities) {
      auto held_there = of_rank.find(key.table);
      if (held_there == of_rank.end()) {
        alike = false;
        break;
      }
      if (!first.has_value()) first = held_there->second;
      alike = alike && held_there->second == *first;
    }
    if (alike) {
      ++it;
      continue;
    }
    auto m = mine.find(it->first);
    if (m != mine.end()) {
      for (StepRequest* r : m->second.reqs) {
        Answer(*r, absl::UnavailableError(absl::StrCat(
                       "table \"", key.table,
                       "\" is not the same on every rank of the group right now (it is being "
                       "created, replaced or dropped); retry")));
      }
    }
    it = work.erase(it);
  }
  return absl::OkStatus();
}

}  // namespace

int64_t StepRequest::Rows() const {
  switch (op) {
    case Op::kEmbedding:
      return std::max<int64_t>(static_cast<int64_t>(ids.size()), 1);
    case Op::kEmbeddingBag:  // ids, or bags where there are more (empty bags are answered too)
      return std::max<int64_t>(
          {static_cast<int64_t>(ids.size()), static_cast<int64_t>(offsets.size()) - 1, 1});
    case Op::kLinear:
      return shape.empty() || shape.back() == 0
                 ? 1
                 : std::max<int64_t>(static_cast<int64_t>(values.size()) / shape.back(), 1);
  }
  return 1;
}

int64_t StepRequest::InputBytes() const {
  return static_cast<int64_t>((ids.size() + offsets.size() + shape.size()) * sizeof(int64_t) +
                              (weights.size() + values.size()) * sizeof(float));
}

absl::Status PrepareRequest(const TableConfig& table, const InputLimits& limits,
                            StepRequest& request, absl::Span<const int64_t> raw_offsets,
                            bool has_offsets, bool include_last_offset) {
  switch (request.op) {
    case StepRequest::Op::kEmbedding:
      return ValidateEmbeddingInput(table, EmbeddingInput{request.ids, request.shape}, limits);
    case StepRequest::Op::kEmbeddingBag: {
      EmbeddingBagInput in;
      in.ids = request.ids;
      in.shape = request.shape;
      if (has_offsets) in.offsets = raw_offsets;
      if (request.has_weights) in.per_sample_weights = absl::MakeConstSpan(request.weights);
      in.mode = request.mode;
      in.include_last_offset = include_last_offset;
      SHARDSERVE_ASSIGN_OR_RETURN(CanonicalBags bags, ValidateEmbeddingBagInput(table, in, limits));
      request.offsets = std::move(bags.offsets);
      return absl::OkStatus();
    }
    case StepRequest::Op::kLinear:
      return ValidateLinearInput(table, LinearInput{request.values, request.shape}, limits)
          .status();
  }
  return absl::InternalError("unknown op");
}

StepLoop::StepLoop(Options options, LocalKernels& kernels)
    : options_(std::move(options)), kernels_(kernels) {
  absl::MutexLock lock(&mu_);
  SetTablesLocked({});
}

StepLoop::~StepLoop() { Stop(); }

void StepLoop::UnparkLocked() {
  if (active_comm_ != nullptr) active_comm_->Unpark();
}

void StepLoop::Start() {
  {
    absl::MutexLock lock(&mu_);
    running_ = true;
  }
  thread_ = std::thread([this] { Run(); });
  park_checker_ = std::thread([this] {
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

void StepLoop::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    UnparkLocked();
  }
  if (thread_.joinable()) thread_.join();
  if (park_checker_.joinable()) park_checker_.join();
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
  for (auto& r : left) Answer(*r, absl::UnavailableError("worker is shutting down"));
}

void StepLoop::SetGroup(std::unique_ptr<Communicator> control, uint64_t epoch,
                        std::unique_ptr<Communicator> data) {
  absl::MutexLock lock(&mu_);
  pending_comm_ = std::move(control);
  pending_data_ = std::move(data);
  pending_epoch_ = epoch;
  UnparkLocked();
}

uint64_t StepLoop::epoch() const {
  absl::MutexLock lock(&mu_);
  return serving_ ? epoch_ : 0;
}

bool StepLoop::serving() const { return serving_.load(std::memory_order_relaxed); }

void StepLoop::SetTablesLocked(std::map<std::string, std::shared_ptr<ShardedTable>> tables) {
  auto set = std::make_shared<TableSet>();
  set->tables = std::move(tables);
  set->digest = Fnv1a("");
  for (const auto& [name, table] : set->tables) {
    const int64_t identity = IdentityOf(table->config());
    set->digest =
        Fnv1a(absl::string_view(reinterpret_cast<const char*>(&identity), 8), set->digest);
  }
  tables_ = std::move(set);
}

void StepLoop::SetTable(std::shared_ptr<ShardedTable> table) {
  absl::MutexLock lock(&mu_);
  auto tables = tables_->tables;
  tables[table->config().name] = std::move(table);
  SetTablesLocked(std::move(tables));
}

void StepLoop::DropTable(const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto tables = tables_->tables;
  tables.erase(name);
  SetTablesLocked(std::move(tables));
}

int64_t StepLoop::busy_steps() const {
  absl::MutexLock lock(&mu_);
  return busy_steps_;
}

void StepLoop::Submit(std::unique_ptr<StepRequest> request) {
  absl::Status refused;
  {
    absl::MutexLock lock(&mu_);
    const int64_t bytes = request->InputBytes();
    if (stop_ || (!serving_ && pending_comm_ == nullptr)) {
      refused = absl::UnavailableError(
          "group not formed: this worker's group is waiting for all its ranks");
    } else if (!queue_.empty() && queued_bytes_ + bytes > options_.max_queued_bytes) {
      refused = absl::ResourceExhaustedError(absl::StrCat(
          "worker overloaded: ", queue_.size(), " requests (", queued_bytes_,
          " bytes of input) are queued, the limit is ", options_.max_queued_bytes,
          " bytes; retry later"));
    } else {
      queued_bytes_ += bytes;
      queue_.push_back(std::move(request));
      UnparkLocked();
      return;
    }
  }
  Answer(*request, refused);
}

void StepLoop::FailAll(std::vector<std::unique_ptr<StepRequest>>& batch,
                       const absl::Status& status) {
  for (auto& r : batch) Answer(*r, status);
}

void StepLoop::Run() {
  loop_thread_id_ = std::this_thread::get_id();
  kernels_.InitThread();
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Communicator> data;  // null: `comm` carries results too
  absl::Duration idle = absl::ZeroDuration();
  int idle_rounds = 0;  // consecutive rounds without work
  std::vector<std::unique_ptr<StepRequest>> batch;
  bool new_group = false;  // its first round is the hello
  int turn = -1;  // one_request_per_step: the rank whose request the last busy step ran
  // A group that parks cheaply has no idle rounds: AwaitRound returned, so the next round runs
  // (a peer may have started it) whether or not this rank has work by then.
  bool round_due = false;
  while (true) {
    if (options_.after_answers) options_.after_answers();  // the last round's answers
    batch.clear();
    // The tables this step runs on; released before the loop waits (a dropped table's memory
    // must not outlive the steps that use it).
    std::shared_ptr<const TableSet> tables;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this, &comm]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stop_ || pending_comm_ != nullptr || comm != nullptr || !between_steps_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stop_) break;
      while (!between_steps_.empty()) {
        std::function<void()> task = std::move(between_steps_.front());
        between_steps_.pop_front();
        mu_.Unlock();
        task();
        mu_.Lock();
      }
      if (comm == nullptr && pending_comm_ == nullptr) continue;
      if (pending_comm_ != nullptr) {
        comm = std::move(pending_comm_);
        active_comm_ = comm.get();
        idle_rounds = 0;  // counted from the group's first round on every rank
        new_group = true;
        turn = -1;
        round_due = false;
        data = std::move(pending_data_);
        epoch_ = pending_epoch_;
        serving_ = true;
      }
      // News from here on (Submit's Unpark) is what a wait before the next round waits for.
      if (!round_due) comm->ClearUnpark();
      int64_t rows = 0;
      while (!queue_.empty() &&
             (batch.empty() || (!options_.one_request_per_step &&
                                rows + queue_.front()->Rows() <= options_.row_budget))) {
        rows += queue_.front()->Rows();
        queued_bytes_ -= queue_.front()->InputBytes();
        batch.push_back(std::move(queue_.front()));
        queue_.pop_front();
      }
      tables = tables_;
    }
    absl::Status broken;
    const absl::Time now = absl::Now();
    bool answered = false;
    for (auto& r : batch) {
      if (r->deadline < now) {
        Answer(*r, absl::DeadlineExceededError("deadline passed in queue"));
        answered = true;
      } else if (tables->tables.count(r->table) == 0) {
        Answer(*r, absl::NotFoundError(absl::StrCat(
                       "table \"", r->table, "\" was dropped while the request waited")));
        answered = true;
      }
    }
    if (answered) {
      batch.erase(
          std::remove_if(batch.begin(), batch.end(), [](const auto& r) { return !r->done; }),
          batch.end());
      if (options_.after_answers) options_.after_answers();  // their answers, before any wait
    }
    if (!round_due && !new_group && batch.empty() && comm->ParksCheaply()) {
      // No work here: instead of an idle round, wait until a peer starts the next round, or news
      // (a request, a task, a new group, Stop, the periodic check) comes.
      tables.reset();
      absl::Status waited = comm->AwaitRound();
      if (waited.ok()) {
        round_due = true;
        continue;
      }
      broken = waited;
      absl::MutexLock lock(&mu_);
      tables = tables_;
    }
    round_due = false;

    // Agreement round: every rank learns which (table, op) work any rank has, and with it every
    // rank's input for that work (so the ops need no input round of their own).
    std::map<std::string, KeyWork> mine;  // this rank's work by key
    for (auto& r : batch) {
      KeyWork& w = mine[KeyOf(*r)];
      w.reqs.push_back(r.get());
      const int64_t base = static_cast<int64_t>(w.ids.size());
      w.ids.insert(w.ids.end(), r->ids.begin(), r->ids.end());
      for (size_t b = 1; b < r->offsets.size(); ++b) w.offsets.push_back(base + r->offsets[b]);
      w.weights.insert(w.weights.end(), r->weights.begin(), r->weights.end());
      w.values.insert(w.values.end(), r->values.begin(), r->values.end());
    }
    if (new_group) {
      new_group = false;
      broken = SayHello(*comm, options_.one_request_per_step, options_.collective_timeout);
    }
    // The message starts with the digest of this rank's tables, so that every rank learns
    // whether the ranks hold the same ones.
    std::vector<int64_t> message = {static_cast<int64_t>(tables->digest)};
    for (auto& [text, w] : mine) {
      if (!broken.ok()) break;
      absl::StatusOr<Key> key = ParseKey(text);
      if (!key.ok()) {
        comm->Abort().IgnoreError();  // peers must not wait for this rank's message
        if (data != nullptr) data->Abort().IgnoreError();
        broken = key.status();
        break;
      }
      w.table = tables->tables.at(key->table);  // held: requests for dropped ones were answered
      const TableConfig& config = w.table->config();
      AppendEntry(message, text, WithInput(*key, w, config.num_cols, [&](const auto& in) {
                    return ShardedOps::InputMessage(config, options_.limits, in);
                  }));
    }
    if (broken.ok()) rounds_.fetch_add(1);
    absl::StatusOr<std::vector<absl::Span<const char>>> views =
        !broken.ok() ? absl::StatusOr<std::vector<absl::Span<const char>>>(broken)
                     : comm->AllGatherMessages(
                           absl::MakeConstSpan(reinterpret_cast<const char*>(message.data()),
                                               message.size() * sizeof(int64_t)),
                           options_.collective_timeout);
    std::vector<std::vector<int64_t>> received;
    std::map<std::string, std::vector<absl::Span<const char>>> work;  // key -> input per rank
    bool same_tables = true;
    if (!views.ok()) {
      broken = views.status();
    } else {
      received.resize(views->size());
      for (size_t q = 0; q < views->size() && broken.ok(); ++q) {
        broken = CopyWords((*views)[q], received[q]);
        if (broken.ok() && received[q].empty()) {
          broken = absl::InternalError("step: bad agreement message");
        }
        std::map<std::string, absl::Span<const char>> entries;
        if (broken.ok()) {
          same_tables = same_tables && received[q][0] == received[0][0];
          broken = ParseEntries(absl::MakeConstSpan(received[q]).subspan(1), entries);
        }
        for (const auto& [text, input] : entries) {
          auto& inputs = work[text];
          inputs.resize(views->size());
          inputs[q] = input;
        }
      }
    }
    if (broken.ok() && options_.one_request_per_step && !work.empty()) {
      // Every rank sees the same rounds, so every rank picks the same one; the others' requests
      // go back to the front of their queues.
      const int world = static_cast<int>(received.size());
      for (int i = 1; i <= world; ++i) {
        if (received[(turn + i) % world].size() > 1) {  // more than the digest: it has work
          turn = (turn + i) % world;
          break;
        }
      }
      for (auto it = work.begin(); it != work.end();) {
        for (int q = 0; q < world; ++q) {
          if (q != turn) it->second[q] = {};
        }
        it = it->second[turn].data() == nullptr ? work.erase(it) : std::next(it);
      }
      if (comm->rank() != turn && !batch.empty()) {
        mine.clear();
        absl::MutexLock lock(&mu_);
        for (auto r = batch.rbegin(); r != batch.rend(); ++r) {
          queued_bytes_ += (*r)->InputBytes();
          queue_.push_front(std::move(*r));
        }
        batch.clear();
      }
    }
    if (broken.ok() && work.empty()) {
      // Idle. A group that parks cheaply goes back to waiting for the next round (AwaitRound).
      // Otherwise back off (each rank sleeps between rounds, waking at once for local work); after
      // park_after_idle_rounds such rounds (the same round on every rank) park the group until any
      // rank has news - work, a new group, a task, Stop. Waking a group parked on sockets costs
      // more than a round, so there traffic with short gaps never parks it.
      tables.reset();
      if (comm->ParksCheaply()) continue;
      if (++idle_rounds > options_.park_after_idle_rounds) {
        broken = comm->Park(options_.collective_timeout);
        if (broken.ok()) continue;
        if (absl::IsUnimplemented(broken)) broken = absl::OkStatus();  // cannot park: back off
      }
      if (broken.ok()) {
        idle = std::min(std::max(idle * 2, absl::Microseconds(50)), options_.max_idle_sleep);
        absl::MutexLock lock(&mu_);
        auto wake = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
          return stop_ || !queue_.empty() || pending_comm_ != nullptr || !between_steps_.empty();
        };
        mu_.AwaitWithTimeout(absl::Condition(&wake), idle);
        continue;
      }
    }
    idle = absl::ZeroDuration();
    idle_rounds = 0;
    std::vector<std::shared_ptr<ShardedTable>> renorm_unsure;  // see Options::on_group_broken
    if (broken.ok()) {
      if (!same_tables) {
        broken = SkipTablesNotHeldAlike(*comm, tables->tables, options_.collective_timeout, work,
                                        mine);
      }
      if (broken.ok() && !work.empty()) {
        absl::MutexLock lock(&mu_);
        ++busy_steps_;
      }
      if (broken.ok()) broken = [&]() -> absl::Status {
        ShardedOps ops(*comm, data != nullptr ? *data : *comm, kernels_,
                       OpOptions{options_.collective_timeout, options_.limits});
        for (auto& [text, inputs] : work) {
          SHARDSERVE_ASSIGN_OR_RETURN(Key key, ParseKey(text));
          auto it = mine.find(text);
          auto held = tables->tables.find(key.table);
          std::shared_ptr<ShardedTable> table =
              it != mine.end()                ? it->second.table
              : held != tables->tables.end() ? held->second
                                             : nullptr;
          if (table == nullptr) {
            // A peer has work for a table this rank does not hold: the group cannot run it.
            comm->Abort().IgnoreError();
            if (data != nullptr) data->Abort().IgnoreError();
            return absl::UnavailableError(
                absl::StrCat("table \"", key.table, "\" is not loaded on this rank"));
          }
          const int64_t in_features = table->config().num_cols;
          const KeyWork none;
          const KeyWork& w = it != mine.end() ? it->second : none;
          // Ranks without work for this key sent no input: theirs is the empty one.
          std::vector<int64_t> empty;
          for (absl::Span<const char>& input : inputs) {
            if (input.data() != nullptr) continue;
            if (empty.empty()) {
              empty = WithInput(key, none, in_features, [&](const auto& in) {
                return ShardedOps::InputMessage(table->config(), options_.limits, in);
              });
            }
            input = absl::Span<const char>(reinterpret_cast<const char*>(empty.data()),
                                           empty.size() * sizeof(int64_t));
          }
          absl::StatusOr<DenseResult> result =
              WithInput(key, w, in_features, [&](const auto& in) {
                return RunOp(ops, *table, in, &inputs);
              });
          const std::vector<StepRequest*>& reqs = w.reqs;
          if (!result.ok()) {
            if (result.status().code() == absl::StatusCode::kUnavailable) {
              const TableConfig& config = table->config();
              if (config.max_norm.has_value() && config.spec.dim() == 1) {
                renorm_unsure.push_back(table);
              }
              return result.status();
            }
            for (StepRequest* r : reqs) Answer(*r, result.status());
            continue;
          }
          // Split the rows back per request: with several requests, each refers to its rows of
          // the one result buffer (no copy).
          const int64_t dim = result->shape.back();
          std::shared_ptr<const FloatBuffer> shared;
          if (reqs.size() > 1) shared = std::make_shared<FloatBuffer>(std::move(result->values));
          int64_t cursor = 0;
          for (StepRequest* r : reqs) {
            DenseResult mine_result;
            int64_t rows = 0;
            switch (r->op) {
              case StepRequest::Op::kEmbedding:
                rows = static_cast<int64_t>(r->ids.size());
                mine_result.shape = r->shape;
                break;
              case StepRequest::Op::kEmbeddingBag:
                rows = static_cast<int64_t>(r->offsets.size()) - 1;
                mine_result.shape = {rows};
                break;
              case StepRequest::Op::kLinear:
                rows = static_cast<int64_t>(r->values.size()) / in_features;
                mine_result.shape.assign(r->shape.begin(), r->shape.end() - 1);
                break;
            }
            mine_result.shape.push_back(dim);
            if (shared == nullptr) {
              mine_result.values = std::move(result->values);
            } else {
              mine_result.shared = shared;
              mine_result.offset = cursor;
              mine_result.count = rows * dim;
              cursor += rows * dim;
            }
            Answer(*r, std::move(mine_result));
          }
        }
        return absl::OkStatus();
      }();
    }
    if (!broken.ok()) {
      const absl::Status status = absl::UnavailableError(
          absl::StrCat("group epoch ", epoch(), " failed: ", broken.message()));
      FailAll(batch, status);
      {
        absl::MutexLock lock(&mu_);
        active_comm_ = nullptr;
      }
      comm.reset();
      data.reset();
      std::deque<std::unique_ptr<StepRequest>> queued;
      {
        absl::MutexLock lock(&mu_);
        serving_ = false;  // from now on Submit refuses at once
        queued.swap(queue_);
        queued_bytes_ = 0;
      }
      for (auto& r : queued) Answer(*r, status);
      tables.reset();
      if (!renorm_unsure.empty()) {
        absl::MutexLock lock(&mu_);
        auto held = tables_->tables;
        for (const std::shared_ptr<ShardedTable>& table : renorm_unsure) {
          auto it = held.find(table->config().name);
          if (it != held.end() && it->second == table) held.erase(it);  // not a newer load
        }
        SetTablesLocked(std::move(held));
      }
      if (options_.on_group_broken) options_.on_group_broken(status, renorm_unsure);
    }
  }
  {
    absl::MutexLock lock(&mu_);
    active_comm_ = nullptr;
  }
  FailAll(batch, absl::UnavailableError("worker is shutting down"));
  if (options_.after_answers) options_.after_answers();
  loop_thread_id_ = std::thread::id();  // a later thread may be given this one's id
}

}  // namespace shardserve::core
