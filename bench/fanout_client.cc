// The ordered fan-out's client (bench/run_updates.sh): the least work a design does that gives
// every replica the same stream of updates and keeps every rank of every replica durable. Each
// caller, in a closed loop: one small call to the sequencer (echo_server --sequencer) for the
// update's place in the stream; then each rank its share of the rows (512 rows x its D / W
// columns) straight from here, sent to every rank at once with the place in an x-sequence header.
// Each rank (echo_server --shard_rows) checks the share, applies it in sequence order, logs and
// syncs it. An update is done once every rank answered. The report is shardserve-load's.
//
// Without --sequencer the same shares go out unordered (to echo_server --log_dir ranks): what
// ordering and applying cost, side by side. With --qps the callers send at that rate in all,
// each update timed from when it was due (open loop; each caller has one update in flight, so a
// slot that comes while it is sends late and counts the wait), instead of each caller sending as
// soon as its last update is done.
//
//   fanout_client [--sequencer=HOST:PORT] --ranks=A,B,C,D --world=2 --rows=100000 --dim=128
//       [--update_rows=512] [--concurrency=16] [--qps=Q] [--warmup_s=1] [--duration_s=5]
//       [--report=F]
#include <atomic>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/load/load_stats.h"
#include "core/base/process_setup.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/shardserve.pb.h"
#include "rpc/grpc_settings.h"
#include "rpc/security.h"

ABSL_FLAG(std::string, sequencer, "",
          "the sequencer's HOST:PORT; without one, updates go to the ranks unordered");
ABSL_FLAG(std::string, ranks, "", "every rank's HOST:PORT, replica by replica; rank i of the list "
                                  "holds column share i % world");
ABSL_FLAG(int, world, 2, "ranks per replica (W): each holds D / W columns");
ABSL_FLAG(int64_t, rows, 100000, "the table's rows");
ABSL_FLAG(int64_t, dim, 128, "the table's columns (D)");
ABSL_FLAG(int64_t, update_rows, 512, "rows per update");
ABSL_FLAG(int, concurrency, 16, "callers, each with one update in flight");
ABSL_FLAG(double, qps, 0,
          "updates per second in all, spread over the callers (0: each caller sends its next "
          "update as soon as its last one is done)");
ABSL_FLAG(double, warmup_s, 1, "seconds not measured");
ABSL_FLAG(double, duration_s, 5, "seconds measured");
ABSL_FLAG(int, deadline_ms, 10000, "each call's deadline");
ABSL_FLAG(std::string, report, "", "write the JSON report here");

namespace shardserve::bench {
namespace {

namespace v1 = shardserve::v1;
constexpr char kUpdateRows[] = "/shardserve.v1.DataService/UpdateRows";

grpc::ByteBuffer Serialize(const v1::UpdateRowsRequest& request) {
  grpc::ByteBuffer bytes;
  bool own = false;
  if (!grpc::SerializationTraits<v1::UpdateRowsRequest>::Serialize(request, &bytes, &own).ok()) {
    std::fprintf(stderr, "fanout_client: cannot serialize\n");
    std::exit(1);
  }
  return bytes;
}

struct Shared {
  std::unique_ptr<grpc::GenericStub> sequencer;
  std::vector<std::unique_ptr<grpc::GenericStub>> ranks;
  int world = 2;
  std::vector<std::vector<grpc::ByteBuffer>> pool;  // [update][column share]
  grpc::ByteBuffer ask;                              // what the sequencer is sent
  client::LoadStats* stats = nullptr;
  absl::Time end;
  absl::Duration deadline;
  int64_t rows_per_update = 0;
  absl::Mutex mu;
  int finished ABSL_GUARDED_BY(mu) = 0;  // callers that stopped
};

// One caller: its update in flight, driven by gRPC's callbacks.
class Caller {
 public:
  Caller(Shared& s, int index) : s_(s), next_(index) {}

  void Start() {
    if (absl::Now() >= s_.end) {
      absl::MutexLock lock(&s_.mu);
      ++s_.finished;
      return;
    }
    Begin();
  }

  // Paced: sends an update at each of this caller's slots, `period` apart from `first`, on the
  // calling thread (one update in flight: a slot that comes while it is waits for it).
  void RunPaced(absl::Time first, absl::Duration period) {
    for (absl::Time slot = first; slot < s_.end; slot += period) {
      absl::SleepFor(slot - absl::Now());
      {
        absl::MutexLock lock(&mu_);
        busy_ = true;
      }
      Begin(slot);  // latency from the slot: a late send counts its wait (open loop)
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(+[](bool* busy) { return !*busy; }, &busy_));
    }
    absl::MutexLock lock(&s_.mu);
    ++s_.finished;
  }

  void set_paced() { paced_ = true; }

 private:
  // Sends one update (its place first, when there is a sequencer), timed from `sent`.
  void Begin(absl::Time sent = absl::Now()) {
    sent_ = sent;
    code_ = 0;
    if (s_.sequencer == nullptr) return Send("");
    ask_context_ = Context();
    s_.sequencer->UnaryCall(ask_context_.get(), kUpdateRows, grpc::StubOptions(), &s_.ask,
                            &answer_, [this](grpc::Status status) { Sequenced(status); });
  }

  // An update is done: the next one now, or at this caller's next slot.
  void Next() {
    if (!paced_) return Start();
    absl::MutexLock lock(&mu_);
    busy_ = false;
  }

  std::unique_ptr<grpc::ClientContext> Context() const {
    auto context = std::make_unique<grpc::ClientContext>();
    context->set_deadline(absl::ToChronoTime(absl::Now() + s_.deadline));
    return context;
  }

  void Sequenced(const grpc::Status& status) {
    v1::UpdateRowsResponse place;
    if (!status.ok() ||
        !grpc::SerializationTraits<v1::UpdateRowsResponse>::Deserialize(&answer_, &place).ok()) {
      s_.stats->Record(sent_, absl::Now(), status.ok() ? grpc::StatusCode::INTERNAL
                                                       : status.error_code(), 0);
      return Next();
    }
    Send(std::to_string(place.sequence()));
  }

  // Sends every rank its share, with the update's place in the stream unless `sequence` is empty.
  void Send(const std::string& sequence) {
    const std::vector<grpc::ByteBuffer>& shares = s_.pool[next_++ % s_.pool.size()];
    const int n = static_cast<int>(s_.ranks.size());
    contexts_.resize(n);
    responses_.resize(n);
    remaining_ = n;
    for (int i = 0; i < n; ++i) {
      contexts_[i] = Context();
      if (!sequence.empty()) contexts_[i]->AddMetadata("x-sequence", sequence);
      s_.ranks[i]->UnaryCall(contexts_[i].get(), kUpdateRows, grpc::StubOptions(),
                             &shares[i % s_.world], &responses_[i],
                             [this](grpc::Status status) { RankDone(status); });
    }
  }

  void RankDone(const grpc::Status& status) {
    if (!status.ok()) code_.store(status.error_code());
    if (remaining_.fetch_sub(1) != 1) return;
    const int code = code_.load();
    s_.stats->Record(sent_, absl::Now(), code, code == 0 ? s_.rows_per_update : 0);
    Next();
  }

  Shared& s_;
  size_t next_;  // the next pool entry
  absl::Time sent_;
  std::unique_ptr<grpc::ClientContext> ask_context_;
  grpc::ByteBuffer answer_;
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts_;
  std::vector<grpc::ByteBuffer> responses_;
  std::atomic<int> remaining_{0};
  std::atomic<int> code_{0};
  bool paced_ = false;
  absl::Mutex mu_;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;  // paced: an update is in flight
};

int Main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  core::SetUpServingProcess();
  const std::vector<std::string> ranks =
      absl::StrSplit(absl::GetFlag(FLAGS_ranks), ',', absl::SkipEmpty());
  const int world = absl::GetFlag(FLAGS_world);
  const int64_t rows = absl::GetFlag(FLAGS_rows), dim = absl::GetFlag(FLAGS_dim);
  const int64_t k = absl::GetFlag(FLAGS_update_rows);
  const int concurrency = absl::GetFlag(FLAGS_concurrency);
  const double qps = absl::GetFlag(FLAGS_qps);
  if (ranks.empty() || world < 1 || dim % world != 0 ||
      ranks.size() % world != 0 || rows < 1 || k < 1 || concurrency < 1 || !std::isfinite(qps) || qps < 0) {
    std::fprintf(stderr,
                 "usage: fanout_client [--sequencer=HOST:PORT] --ranks=A,B,... --world=W (dividing "
                 "the ranks and --dim) [--rows --dim --update_rows --concurrency ...]\n");
    return 2;
  }
  Shared s;
  s.world = world;
  s.rows_per_update = k;
  s.deadline = absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms));
  auto stub = [](const std::string& address) {
    grpc::ChannelArguments args = rpc::ChannelArguments();
    args.SetInt("grpc.use_local_subchannel_pool", 1);
    return std::make_unique<grpc::GenericStub>(
        rpc::CreateChannel(address, rpc::PlaintextChannels(), args));
  };
  if (!absl::GetFlag(FLAGS_sequencer).empty()) s.sequencer = stub(absl::GetFlag(FLAGS_sequencer));
  for (const std::string& r : ranks) s.ranks.push_back(stub(r));
  // 16 updates of random rows and small deltas (as shardserve-load's pool), each cut into the W
  // ranks' columns.
  std::mt19937_64 rng(1);
  std::uniform_int_distribution<int64_t> id(0, rows - 1);
  std::uniform_real_distribution<float> value(-1, 1);
  const int64_t share_cols = dim / world;
  for (int u = 0; u < 16; ++u) {
    std::vector<int64_t> ids(k);
    for (int64_t& v : ids) v = id(rng);
    std::vector<float> delta(k * dim);
    for (float& v : delta) v = value(rng) * 1e-3f;
    std::vector<grpc::ByteBuffer> shares;
    for (int w = 0; w < world; ++w) {
      std::vector<float> cols(k * share_cols);
      for (int64_t i = 0; i < k; ++i) {
        std::copy_n(delta.begin() + i * dim + w * share_cols, share_cols,
                    cols.begin() + i * share_cols);
      }
      v1::UpdateRowsRequest share;
      share.set_table("bench");
      share.set_op(v1::ADD);
      *share.mutable_ids() = client::Int64Tensor({k}, ids);
      *share.mutable_values() = client::FloatTensor({k, share_cols}, cols);
      shares.push_back(Serialize(share));
    }
    s.pool.push_back(std::move(shares));
  }
  v1::UpdateRowsRequest ask;
  ask.set_table("bench");
  s.ask = Serialize(ask);

  const absl::Time start = absl::Now();
  const absl::Time measure_from = start + absl::Seconds(absl::GetFlag(FLAGS_warmup_s));
  s.end = measure_from + absl::Seconds(absl::GetFlag(FLAGS_duration_s));
  client::LoadStats stats(start, measure_from);
  s.stats = &stats;
  std::vector<std::unique_ptr<Caller>> callers;
  for (int c = 0; c < concurrency; ++c) callers.push_back(std::make_unique<Caller>(s, c));
  std::vector<std::thread> pacers;
  if (qps > 0) {
    // Caller c sends at start + (c + i * concurrency) / qps: together, one update every 1 / qps.
    for (int c = 0; c < concurrency; ++c) {
      callers[c]->set_paced();
      pacers.emplace_back(&Caller::RunPaced, callers[c].get(), start + absl::Seconds(c / qps),
                          absl::Seconds(concurrency / qps));
    }
  } else {
    for (auto& c : callers) c->Start();
  }
  // Every caller stops by the end plus one deadline: a call outlives neither.
  {
    absl::MutexLock lock(&s.mu);
    const auto all_stopped = [&] {
      s.mu.AssertHeld();
      return s.finished == concurrency;
    };
    if (!s.mu.AwaitWithDeadline(absl::Condition(&all_stopped),
                                s.end + s.deadline + absl::Seconds(5))) {
      std::fprintf(stderr, "fanout_client: callers did not stop\n");
      std::_Exit(1);
    }
  }
  for (std::thread& t : pacers) t.join();
  const double measured = absl::ToDoubleSeconds(s.end - measure_from);
  std::fprintf(stderr, "fanout_client: %lld updates, %.0f rows/s, p50 %.0f us, p99 %.0f us\n",
               static_cast<long long>(stats.calls()), stats.items() / measured,
               stats.Overall().p50_us, stats.Overall().p99_us);
  if (const std::string path = absl::GetFlag(FLAGS_report); !path.empty()) {
    const std::string config = absl::StrFormat(
        "\"sequenced\": %s, \"ranks\": %d, \"world\": %d, \"update_rows\": %d, "
        "\"concurrency\": %d, \"qps\": %g",
        s.sequencer != nullptr ? "true" : "false", static_cast<int>(ranks.size()), world, k,
        concurrency, qps);
    std::ofstream(path) << client::ReportJson(config, stats, s.end - measure_from, "rows");
  }
  // The last callbacks may still be returning on gRPC's threads: leave without destroying the
  // callers under them.
  std::fflush(nullptr);
  std::_Exit(0);
}

}  // namespace
}  // namespace shardserve::bench

int main(int argc, char** argv) { return shardserve::bench::Main(argc, argv); }
