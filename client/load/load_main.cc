// shardserve-load: the load tester users size a deployment with.
//
// Closed loop (--concurrency callers, each waiting for its answer) or open loop (--qps, Poisson
// arrivals; latency is measured from each call's intended send time, so a slow server cannot hide
// its queueing). Ops Embedding / EmbeddingBag / Linear or a --mix; ids uniform or Zipf(--zipf);
// unary or --stream (pipelined, --pipeline calls in flight per stream); --warmup_s then
// --duration_s. Prints a live progress line, then a latency summary (of OK calls, and of failed
// ones) and errors by status code; --report writes JSON (with a timeline in --timeline_ms bins),
// --svg a chart of latency percentiles and throughput over time. In a closed loop a caller whose
// call failed waits before its next one (--backoff_ms, doubling up to --max_backoff_ms, reset by
// a success), so that a failing server is not flooded with retries. Unary calls go where the
// C++ client sends them and fail over as it does (rpc::ReplicaCaller: another replica on
// UNAVAILABLE, a hedge after --hedge_ms without an answer, all within the call's deadline); the
// report counts each call once, by its final outcome.
//
//   shardserve-load --coordinator=127.0.0.1:50051 --table=demo_embeddings --op=embedding_bag \
//       --batch=512 --bag=20 --concurrency=4 --duration_s=10
#include <atomic>
#include <cmath>
#include <cstdio>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/synchronization/mutex.h"
#include "client/client.h"
#include "client/load/load_stats.h"
#include "core/base/process_setup.h"
#include "grpcpp/create_channel.h"
#include "rpc/cli.h"
#include "rpc/grpc_settings.h"
#include "rpc/routing/delayer.h"
#include "rpc/routing/replica_caller.h"
#include "rpc/routing/replica_router.h"
#include "rpc/security_flags.h"

ABSL_FLAG(std::string, coordinator, "127.0.0.1:50051", "coordinator address");
ABSL_FLAG(std::string, target, "", "send to this address only (skips the placement map)");
ABSL_FLAG(bool, via_coordinator, false, "send data calls to the coordinator (it forwards)");
ABSL_FLAG(std::string, table, "", "embedding table (embedding, embedding_bag)");
ABSL_FLAG(std::string, linear_table, "", "linear layer (linear)");
ABSL_FLAG(std::string, op, "embedding_bag",
          "embedding | embedding_bag | linear | update | mix");
ABSL_FLAG(std::string, mix, "embedding_bag=0.8,embedding=0.1,linear=0.1",
          "op weights for --op=mix");
ABSL_FLAG(int64_t, batch, 512,
          "bags (embedding_bag), id rows (embedding) or input rows (linear) per call");
ABSL_FLAG(int64_t, bag, 20, "ids per bag / per embedding row");
ABSL_FLAG(double, update_fraction, 0,
          "the share of calls that are UpdateRows (ADD of random deltas to --update_rows random "
          "rows of --table), added to the --op/--mix read calls; with updates, calls are never "
          "hedged nor retried (an ADD sent twice would add twice)");
ABSL_FLAG(int64_t, update_rows, 512, "rows per UpdateRows call");
ABSL_FLAG(int64_t, dim, 0, "with --target: the embedding table's embedding_dim (for updates)");
ABSL_FLAG(std::string, mode, "sum", "bag mode: sum | mean | max");
ABSL_FLAG(std::string, dist, "uniform", "ids: uniform | zipf");
ABSL_FLAG(double, zipf, 1.1, "Zipf exponent for --dist=zipf");
ABSL_FLAG(int64_t, rows, 0, "with --target: the table's num_rows");
ABSL_FLAG(int64_t, cols, 0, "with --target: in_features of the linear layer");
ABSL_FLAG(int, concurrency, 1, "closed loop: concurrent callers");
ABSL_FLAG(double, qps, 0, "open loop: target calls per second (0: closed loop)");
ABSL_FLAG(bool, stream, false, "use the Stream RPC (closed loop)");
ABSL_FLAG(int, pipeline, 1, "--stream: calls in flight per stream");
ABSL_FLAG(double, warmup_s, 2, "seconds of warm-up, not measured");
ABSL_FLAG(double, duration_s, 10, "seconds measured");
ABSL_FLAG(int, deadline_ms, 5000,
          "deadline of each call; with --stream, of each stream after the run's end (the server "
          "holds a stream's requests to the stream's deadline)");
ABSL_FLAG(std::string, report, "", "write the JSON report here");
ABSL_FLAG(std::string, svg, "", "write the latency/throughput chart here");
ABSL_FLAG(std::string, calls_csv, "",
          "write every measured call here as CSV: sent_s,done_s,latency_us,code");
ABSL_FLAG(bool, progress, true, "live progress line on stderr");
ABSL_FLAG(uint64_t, seed, 1, "random seed of the generated requests");
ABSL_FLAG(int, timeline_ms, 1000, "width of the report's timeline bins");
ABSL_FLAG(int, backoff_ms, 1, "closed loop: a caller's wait after a failed call (0: none)");
ABSL_FLAG(int, max_backoff_ms, 100, "closed loop: the longest wait after failed calls");
ABSL_FLAG(int, hedge_ms, 50,
          "unary: a call without an answer this long goes to another replica too (0: never)");
ABSL_FLAG(int, max_attempts, 8,
          "unary: attempts per call (failover to other replicas included; 1: no retries)");

namespace shardserve::client {
namespace {

using rpc::Delayer;

enum class Op { kEmbedding, kBag, kLinear, kUpdate };

// A caller's wait before its next call: none while calls succeed; after a failure
// --backoff_ms, doubling with each failure in a row up to --max_backoff_ms.
class Backoff {
 public:
  absl::Duration After(bool ok) {
    const absl::Duration first = absl::Milliseconds(absl::GetFlag(FLAGS_backoff_ms));
    const absl::Duration most = absl::Milliseconds(absl::GetFlag(FLAGS_max_backoff_ms));
    wait_ = ok || first <= absl::ZeroDuration() ? absl::ZeroDuration()
                                                 : std::min(std::max(wait_ * 2, first), most);
    return wait_;
  }

 private:
  absl::Duration wait_ = absl::ZeroDuration();
};

// Ids from a uniform or Zipf distribution; Zipf's popular ids are scattered over the table.
class IdSource {
 public:
  IdSource(int64_t n, bool zipf, double alpha, uint64_t seed) : n_(n), zipf_(zipf), rng_(seed) {
    if (!zipf_) return;
    cdf_.resize(n);
    double total = 0;
    for (int64_t k = 0; k < n; ++k) cdf_[k] = (total += 1.0 / std::pow(k + 1.0, alpha));
    for (double& c : cdf_) c /= total;
  }
  int64_t Next() {
    if (!zipf_) return std::uniform_int_distribution<int64_t>(0, n_ - 1)(rng_);
    const double u = std::uniform_real_distribution<double>(0, 1)(rng_);
    const int64_t rank = std::lower_bound(cdf_.begin(), cdf_.end(), u) - cdf_.begin();
    return static_cast<int64_t>(
        (static_cast<unsigned __int128>(std::min(rank, n_ - 1)) * 2654435761u) % n_);
  }

 private:
  int64_t n_;
  bool zipf_;
  std::mt19937_64 rng_;
  std::vector<double> cdf_;
};

struct Workload {
  std::vector<Op> schedule;  // ops in mix proportion, cycled
  std::map<Op, std::vector<v1::StreamRequest>> pool;  // pre-built requests per op
  std::map<Op, std::vector<grpc::ByteBuffer>> bytes;  // the same, serialized for unary calls
  static const char* Method(Op op) {
    return op == Op::kEmbedding ? "/shardserve.v1.DataService/Embedding"
           : op == Op::kBag     ? "/shardserve.v1.DataService/EmbeddingBag"
           : op == Op::kUpdate  ? "/shardserve.v1.DataService/UpdateRows"
                                : "/shardserve.v1.DataService/Linear";
  }
  static std::string Table(Op op) {
    return op == Op::kLinear ? absl::GetFlag(FLAGS_linear_table) : absl::GetFlag(FLAGS_table);
  }
  int64_t Items(Op op) const {
    const int64_t b = absl::GetFlag(FLAGS_batch);
    if (op == Op::kUpdate) return absl::GetFlag(FLAGS_update_rows);
    return op == Op::kEmbedding ? b * absl::GetFlag(FLAGS_bag) : b;
  }
};

// One closed-loop caller on a Stream: keeps up to `depth` requests in flight until `end`, then
// closes its side and ends when every answer is in. Runs on gRPC's callback threads.
class StreamCaller final : public grpc::ClientBidiReactor<v1::StreamRequest, v1::StreamResponse> {
 public:
  StreamCaller(const Workload& w, LoadStats& stats, int depth, int64_t first, absl::Time end,
               absl::Duration deadline, absl::BlockingCounter& done, Delayer& delayer)
      : w_(w), stats_(stats), depth_(depth), next_(first), end_(end), done_(done),
        delayer_(delayer) {
    context_.set_deadline(absl::ToChronoTime(end + deadline));
  }

  void Begin(v1::DataService::Stub& stub) {
    stub.async()->Stream(&context_, this);
    StartRead(&response_);
    Actions actions;
    {
      absl::MutexLock lock(&mu_);
      actions = Fill();
    }
    Apply(actions);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // the stream ended: OnDone follows
    Actions actions;
    {
      absl::MutexLock lock(&mu_);
      auto it = in_flight_.find(response_.id());
      if (it != in_flight_.end()) {
        stats_.Record(it->second.first, absl::Now(), response_.code(), it->second.second);
        in_flight_.erase(it);
      }
      const absl::Duration wait = backoff_.After(response_.code() == 0);
      if (wait > absl::ZeroDuration() && !paused_) {
        // Send nothing more until the wait is over (the answers in flight still come).
        paused_ = true;
        AddHold();
        delayer_.At(absl::Now() + wait, [this] {
          Actions resumed;
          {
            absl::MutexLock lock(&mu_);
            paused_ = false;
            resumed = Fill();
          }
          Apply(resumed);
          RemoveHold();
        });
      }
      actions = Fill();
    }
    StartRead(&response_);
    Apply(actions);
  }

  void OnWriteDone(bool ok) override {
    Actions actions;
    {
      absl::MutexLock lock(&mu_);
      queue_.pop_front();
      writing_ = false;
      if (!ok) {  // the stream broke: no more writes; reads end, then OnDone
        broken_ = true;
        return;
      }
      actions = Fill();
    }
    Apply(actions);
  }

  void OnDone(const grpc::Status& status) override {
    if (!status.ok()) stats_.Record(absl::Now(), absl::Now(), status.error_code(), 0);
    done_.DecrementCount();
    delete this;
  }

 private:
  struct Actions {
    const v1::StreamRequest* write = nullptr;
    bool close = false;
  };

  // Queues requests up to the pipeline depth (until `end`) and says what to start, outside the
  // lock: the next write, or closing the writes once nothing is left in flight.
  Actions Fill() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    const absl::Time now = absl::Now();
    while (!paused_ && now < end_ && static_cast<int>(in_flight_.size()) < depth_) {
      const Op op = w_.schedule[next_ % w_.schedule.size()];
      queue_.push_back(w_.pool.at(op)[next_ % w_.pool.at(op).size()]);
      ++next_;
      queue_.back().set_id(++id_);
      in_flight_[id_] = {now, w_.Items(op)};
    }
    Actions actions;
    if (writing_ || closed_ || broken_) return actions;
    if (!queue_.empty()) {
      writing_ = true;
      actions.write = &queue_.front();
    } else if (now >= end_ && in_flight_.empty() && !paused_) {
      closed_ = true;
      actions.close = true;
    }
    return actions;
  }

  void Apply(const Actions& actions) {
    if (actions.write != nullptr) StartWrite(actions.write);
    if (actions.close) StartWritesDone();
  }

  const Workload& w_;
  LoadStats& stats_;
  const int depth_;
  int64_t next_;  // index of the next request in the workload
  const absl::Time end_;
  absl::BlockingCounter& done_;
  Delayer& delayer_;
  grpc::ClientContext context_;
  v1::StreamResponse response_;  // the answer being read
  absl::Mutex mu_;
  std::deque<v1::StreamRequest> queue_ ABSL_GUARDED_BY(mu_);  // [0] is being written
  std::map<uint64_t, std::pair<absl::Time, int64_t>> in_flight_ ABSL_GUARDED_BY(mu_);
  uint64_t id_ ABSL_GUARDED_BY(mu_) = 0;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  bool broken_ ABSL_GUARDED_BY(mu_) = false;  // a write failed
  bool paused_ ABSL_GUARDED_BY(mu_) = false;  // backing off after a failed call
  Backoff backoff_ ABSL_GUARDED_BY(mu_);
};

absl::StatusOr<Workload> BuildWorkload(int64_t rows, int64_t in_features, int64_t dim) {
  Workload w;
  std::map<Op, double> weights;
  const std::string op = absl::GetFlag(FLAGS_op);
  const std::map<std::string, Op> names = {{"embedding", Op::kEmbedding},
                                           {"embedding_bag", Op::kBag},
                                           {"linear", Op::kLinear},
                                           {"update", Op::kUpdate}};
  if (op == "mix") {
    for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_mix), ',')) {
      std::vector<std::string> kv = absl::StrSplit(part, '=');
      double weight = 0;
      if (kv.size() != 2 || !names.count(kv[0]) || !absl::SimpleAtod(kv[1], &weight) ||
          weight < 0) {
        return absl::InvalidArgumentError(absl::StrCat("--mix: bad entry \"", part, "\""));
      }
      weights[names.at(kv[0])] = weight;
    }
  } else if (names.count(op)) {
    weights[names.at(op)] = 1;
  } else {
    return absl::InvalidArgumentError(
        "--op must be embedding, embedding_bag, linear, update or mix");
  }
  if (const double f = absl::GetFlag(FLAGS_update_fraction); f > 0) {
    if (f >= 1) return absl::InvalidArgumentError("--update_fraction must be in [0, 1)");
    double reads = 0;
    for (const auto& [o, weight] : weights) reads += weight;
    weights[Op::kUpdate] += reads * f / (1 - f);
  }
  if (weights.count(Op::kUpdate) && (dim <= 0 || absl::GetFlag(FLAGS_update_rows) <= 0)) {
    return absl::InvalidArgumentError(
        "updates need --table's embedding_dim (--dim with --target) and --update_rows >= 1");
  }
  for (const auto& [o, weight] : weights) {
    for (int k = 0; k < static_cast<int>(std::lround(weight * 100)); ++k) w.schedule.push_back(o);
  }
  if (w.schedule.empty()) return absl::InvalidArgumentError("--mix: all weights are zero");
  std::shuffle(w.schedule.begin(), w.schedule.end(), std::mt19937(absl::GetFlag(FLAGS_seed)));
  const int64_t batch = absl::GetFlag(FLAGS_batch), bag = absl::GetFlag(FLAGS_bag);
  const std::string mode = absl::GetFlag(FLAGS_mode);
  IdSource ids(std::max<int64_t>(rows, 1), absl::GetFlag(FLAGS_dist) == "zipf",
               absl::GetFlag(FLAGS_zipf), absl::GetFlag(FLAGS_seed));
  std::mt19937 rng(absl::GetFlag(FLAGS_seed));
  std::uniform_real_distribution<float> value(-1, 1);
  constexpr int kPool = 16;
  for (const auto& [o, weight] : weights) {
    for (int k = 0; k < kPool; ++k) {
      v1::StreamRequest r;
      if (o == Op::kUpdate) {
        const int64_t n = absl::GetFlag(FLAGS_update_rows);
        std::vector<int64_t> id(n);
        for (int64_t& v : id) v = ids.Next();
        std::vector<float> delta(n * dim);
        for (float& v : delta) v = value(rng) * 1e-3f;  // a trainer's small scaled gradient
        v1::UpdateRowsRequest* u = r.mutable_update_rows();
        u->set_table(absl::GetFlag(FLAGS_table));
        u->set_op(v1::ADD);
        *u->mutable_ids() = Int64Tensor({n}, id);
        *u->mutable_values() = FloatTensor({n, dim}, delta);
      } else if (o == Op::kLinear) {
        std::vector<float> x(batch * in_features);
        for (float& v : x) v = value(rng);
        r.mutable_linear()->set_table(absl::GetFlag(FLAGS_linear_table));
        *r.mutable_linear()->mutable_input() = FloatTensor({batch, in_features}, x);
      } else {
        std::vector<int64_t> id(batch * bag);
        for (int64_t& v : id) v = ids.Next();
        if (o == Op::kEmbedding) {
          r.mutable_embedding()->set_table(absl::GetFlag(FLAGS_table));
          *r.mutable_embedding()->mutable_ids() = Int64Tensor({batch, bag}, id);
        } else {
          r.mutable_embedding_bag()->set_table(absl::GetFlag(FLAGS_table));
          *r.mutable_embedding_bag()->mutable_ids() = Int64Tensor({batch, bag}, id);
          r.mutable_embedding_bag()->set_mode(mode == "mean"  ? v1::POOL_MODE_MEAN
                                              : mode == "max" ? v1::POOL_MODE_MAX
                                                              : v1::POOL_MODE_SUM);
        }
      }
      grpc::ByteBuffer bytes;
      bool own = false;
      const google::protobuf::Message& m =
          o == Op::kUpdate      ? static_cast<const google::protobuf::Message&>(r.update_rows())
          : o == Op::kLinear    ? static_cast<const google::protobuf::Message&>(r.linear())
          : o == Op::kEmbedding ? static_cast<const google::protobuf::Message&>(r.embedding())
                                : static_cast<const google::protobuf::Message&>(r.embedding_bag());
      if (!grpc::SerializationTraits<google::protobuf::Message>::Serialize(m, &bytes, &own).ok()) {
        return absl::InternalError("cannot serialize a request");
      }
      w.bytes[o].push_back(std::move(bytes));
      w.pool[o].push_back(std::move(r));
    }
  }
  return w;
}

int Main(int argc, char** argv) {
  rpc::ParseFlags(argc, argv, [](const std::vector<std::string>&) {
    return rpc::Usage{
        "shardserve-load --coordinator=HOST:PORT --table=T [flags]",
        "The load tester: closed loop (--concurrency callers) or open loop (--qps), unary or "
        "--stream; prints latency percentiles and errors by code, --report writes JSON. Exit "
        "codes: 0 done (whatever the calls answered), 1 a local failure, 2 usage, 64 + the gRPC "
        "code when the table cannot be read.",
        {},
        "client/load/load_main.cc"};
  });
  core::SetUpServingProcess();
  const absl::StatusOr<rpc::ChannelSecurity> channels =
      rpc::MakeChannelSecurity(rpc::SecurityOptionsFromFlags());
  if (!channels.ok()) {
    std::fprintf(stderr, "shardserve-load: %s\n", channels.status().ToString().c_str());
    return rpc::kExitUsage;
  }
  std::vector<std::string> addresses;
  std::unique_ptr<Client> admin;  // reads the placement maps
  bool replicated = false;  // --table is on several groups: its updates go to the coordinator
  int64_t rows = absl::GetFlag(FLAGS_rows), in_features = absl::GetFlag(FLAGS_cols);
  int64_t dim = absl::GetFlag(FLAGS_dim);
  if (!absl::GetFlag(FLAGS_target).empty()) {
    addresses.push_back(absl::GetFlag(FLAGS_target));
  } else {
    ClientOptions client_options;
    client_options.security = *channels;
    absl::StatusOr<std::unique_ptr<Client>> client =
        Client::Connect(absl::GetFlag(FLAGS_coordinator), client_options);
    if (!client.ok()) {
      std::fprintf(stderr, "shardserve-load: %s\n", client.status().ToString().c_str());
      return rpc::kExitUsage;
    }
    for (const std::string& name :
         {absl::GetFlag(FLAGS_table), absl::GetFlag(FLAGS_linear_table)}) {
      if (name.empty()) continue;
      absl::StatusOr<v1::TableInfo> info = (*client)->DescribeTable(name);
      if (!info.ok()) {
        std::fprintf(stderr, "shardserve-load: %s\n", info.status().ToString().c_str());
        return rpc::ExitCodeOf(info.status());
      }
      if (info->spec().kind() == v1::TABLE_KIND_LINEAR) {
        in_features = info->spec().num_cols();
      } else {
        rows = info->spec().num_rows();
        dim = info->spec().num_cols();
        replicated = info->replicas_size() > 1;
      }
      auto add = [&](const v1::ShardInfo& s) {
        if (std::find(addresses.begin(), addresses.end(), s.address()) == addresses.end()) {
          addresses.push_back(s.address());
        }
      };
      for (const v1::ReplicaInfo& r : info->replicas()) {
        for (const v1::ShardInfo& s : r.shards()) add(s);
      }
      for (const v1::ShardInfo& s : info->shards()) add(s);
    }
    if (absl::GetFlag(FLAGS_via_coordinator)) addresses = {absl::GetFlag(FLAGS_coordinator)};
    admin = *std::move(client);
  }
  // Unary calls: routed over the tables' replicas as the client does - or, with --target or
  // --via_coordinator, to that one address (retried there on UNAVAILABLE).
  const bool fixed = !absl::GetFlag(FLAGS_target).empty() || absl::GetFlag(FLAGS_via_coordinator);
  rpc::ReplicaRouter router(
      [&](const std::string& table) -> absl::StatusOr<v1::TableInfo> {
        if (!fixed) return admin->DescribeTable(table);
        v1::TableInfo info;
        v1::ReplicaInfo* replica = info.add_replicas();
        replica->set_state(v1::TABLE_STATE_SERVING);
        replica->add_shards()->set_address(addresses[0]);
        return info;
      },
      rpc::ReplicaRouter::Options());
  rpc::ReplicaCallerOptions call_options;
  call_options.hedge_after = absl::Milliseconds(absl::GetFlag(FLAGS_hedge_ms));
  call_options.max_attempts = std::max(1, absl::GetFlag(FLAGS_max_attempts));
  const std::string op = absl::GetFlag(FLAGS_op);
  if (op == "update" || absl::GetFlag(FLAGS_update_fraction) > 0 ||
      (op == "mix" && absl::StrContains(absl::GetFlag(FLAGS_mix), "update"))) {
    // An update is sent once: a second ADD would add twice.
    call_options.hedge_after = absl::ZeroDuration();
    call_options.max_attempts = 1;
  }
  call_options.security = *channels;
  call_options.channel_args = {{"grpc.use_local_subchannel_pool", 1}};
  rpc::ReplicaCaller caller(router, call_options);
  // A replicated table's updates: to the coordinator, which sequences them for every replica.
  rpc::ReplicaRouter coordinator_router(
      [&](const std::string&) -> absl::StatusOr<v1::TableInfo> {
        v1::TableInfo info;
        v1::ReplicaInfo* replica = info.add_replicas();
        replica->set_state(v1::TABLE_STATE_SERVING);
        replica->add_shards()->set_address(absl::GetFlag(FLAGS_coordinator));
        return info;
      },
      rpc::ReplicaRouter::Options());
  rpc::ReplicaCaller coordinator_caller(coordinator_router, call_options);
  auto caller_for = [&](Op op) -> rpc::ReplicaCaller& {
    return op == Op::kUpdate && replicated ? coordinator_caller : caller;
  };
  absl::StatusOr<Workload> workload = BuildWorkload(rows, in_features, dim);
  if (!workload.ok()) {
    std::fprintf(stderr, "shardserve-load: %s\n", workload.status().ToString().c_str());
    return 2;
  }
  std::vector<std::shared_ptr<v1::DataService::Stub>> stubs;
  for (const std::string& a : addresses) {
    grpc::ChannelArguments args = rpc::ChannelArguments();
    args.SetInt("grpc.use_local_subchannel_pool", 1);
    stubs.push_back(v1::DataService::NewStub(rpc::CreateChannel(a, *channels, args)));
  }
  const absl::Time start = absl::Now();
  const absl::Time measure_from = start + absl::Seconds(absl::GetFlag(FLAGS_warmup_s));
  const absl::Time end = measure_from + absl::Seconds(absl::GetFlag(FLAGS_duration_s));
  LoadStats stats(start, measure_from,
                  absl::Milliseconds(std::max(1, absl::GetFlag(FLAGS_timeline_ms))));
  if (!absl::GetFlag(FLAGS_calls_csv).empty()) stats.KeepCalls();
  Delayer delayer;
  const absl::Duration deadline = absl::Milliseconds(absl::GetFlag(FLAGS_deadline_ms));
  std::atomic<bool> done{false};
  std::thread progress([&] {
    absl::Time next = start + absl::Seconds(1);
    while (!done) {
      absl::SleepFor(
          std::max(absl::ZeroDuration(), std::min(next - absl::Now(), absl::Milliseconds(100))));
      if (absl::Now() >= next) {
        if (absl::GetFlag(FLAGS_progress))
          std::fprintf(stderr, "%s\n", stats.ProgressLine(absl::Now()).c_str());
        next += absl::Seconds(1);
      }
    }
  });
  const Workload& w = *workload;
  const double qps = absl::GetFlag(FLAGS_qps);
  if (qps > 0) {
    // Open loop: Poisson arrivals; each call's latency counts from its intended send time.
    std::mt19937_64 rng(absl::GetFlag(FLAGS_seed));
    std::exponential_distribution<double> gap(qps);
    std::atomic<int64_t> outstanding{0};
    absl::Time intended = start;
    int64_t i = 0;
    while (intended < end) {
      intended += absl::Seconds(gap(rng));
      const absl::Time now = absl::Now();
      if (intended > now) absl::SleepFor(intended - now);
      const Op op = w.schedule[i % w.schedule.size()];
      const grpc::ByteBuffer& bytes = w.bytes.at(op)[i % w.bytes.at(op).size()];
      const int64_t items = w.Items(op);
      ++i;
      if (outstanding.load() > 20000) {  // the client itself cannot keep up: count, never hide
        stats.Record(intended, absl::Now(), static_cast<int>(grpc::StatusCode::RESOURCE_EXHAUSTED),
                     0);
        continue;
      }
      ++outstanding;
      const absl::Time sent = intended;
      caller_for(op).Call(Workload::Table(op), Workload::Method(op), bytes, intended + deadline,
                          [&, sent, items](const grpc::Status& status, grpc::ByteBuffer) {
                            stats.Record(sent, absl::Now(), status.error_code(), items);
                            --outstanding;
                          });
    }
    while (outstanding.load() > 0) absl::SleepFor(absl::Milliseconds(5));
  } else {
    const int callers = absl::GetFlag(FLAGS_concurrency);
    const bool stream = absl::GetFlag(FLAGS_stream);
    const int depth = std::max(1, absl::GetFlag(FLAGS_pipeline));
    if (!stream) {
      // Unary closed loop: each caller is a chain of asynchronous calls (the answer to one sends
      // the next), so hundreds of callers need no thread each.
      std::atomic<int> live{callers};
      std::vector<Backoff> backoffs(callers);  // each touched by its caller's chain only
      std::function<void(int, int64_t)> issue = [&](int c, int64_t i) {
        if (absl::Now() >= end) {
          --live;
          return;
        }
        const Op op = w.schedule[i % w.schedule.size()];
        const grpc::ByteBuffer& bytes = w.bytes.at(op)[i % w.bytes.at(op).size()];
        const absl::Time sent = absl::Now();
        const int64_t items = w.Items(op);
        caller_for(op).Call(Workload::Table(op), Workload::Method(op), bytes, sent + deadline,
                            [&, c, i, sent, items](const grpc::Status& status, grpc::ByteBuffer) {
                              stats.Record(sent, absl::Now(), status.error_code(), items);
                              const absl::Duration wait = backoffs[c].After(status.ok());
                              if (wait > absl::ZeroDuration()) {
                                delayer.At(absl::Now() + wait, [&issue, c, i] { issue(c, i + 1); });
                              } else {
                                issue(c, i + 1);
                              }
                            });
      };
      for (int c = 0; c < callers; ++c) issue(c, c * 7919);
      while (live.load() > 0) absl::SleepFor(absl::Milliseconds(5));
    }
    if (stream) {
      absl::BlockingCounter streams_done(callers);
      for (int c = 0; c < callers; ++c) {
        (new StreamCaller(w, stats, depth, c * int64_t{7919}, end, deadline, streams_done, delayer))
            ->Begin(*stubs[c % stubs.size()]);
      }
      streams_done.Wait();
    }
  }
  done = true;
  progress.join();
  const std::string item_name = absl::GetFlag(FLAGS_op) == "embedding_bag" ? "bags"
                                : absl::GetFlag(FLAGS_op) == "embedding"   ? "ids"
                                : absl::GetFlag(FLAGS_op) == "linear"      ? "rows"
                                : absl::GetFlag(FLAGS_op) == "update"      ? "rows"
                                                                            : "items";
  const Percentiles p = stats.Overall();
  const double seconds = absl::ToDoubleSeconds(end - measure_from);
  std::printf(
      "%s %s: %.0f calls/s, %.0f %s/s over %.1f s; latency p50 %.0f us, p90 %.0f us, "
      "p99 %.0f us, p99.9 %.0f us, max %.0f us\n",
      absl::GetFlag(FLAGS_op).c_str(), qps > 0 ? "open loop" : "closed loop",
      stats.calls() / seconds, stats.items() / seconds, item_name.c_str(), seconds, p.p50_us,
      p.p90_us, p.p99_us, p.p999_us, p.max_us);
  const auto histogram = stats.Histogram();
  int64_t most = 1;
  for (const auto& [le, n] : histogram) most = std::max(most, n);
  for (const auto& [le, n] : histogram) {  // latency histogram, one row per bucket
    std::printf("  <= %9.0f us %9lld %s\n", le, static_cast<long long>(n),
                std::string(static_cast<size_t>(40.0 * n / most), '#').c_str());
  }
  for (const auto& [code, n] : stats.Errors())
    std::printf("  errors with status %d: %lld\n", code, static_cast<long long>(n));
  if (const Percentiles f = stats.Failed(); f.count > 0) {
    std::printf("  failed calls' latency: p50 %.0f us, p99 %.0f us, max %.0f us\n", f.p50_us,
                f.p99_us, f.max_us);
  }
  const std::string config = absl::StrFormat(
      "\"impl\": \"shardserve\", \"op\": \"%s\", \"loop\": \"%s\", \"concurrency\": %d, \"qps\": "
      "%.1f, "
      "\"stream\": %s, \"batch\": %d, \"bag\": %d, \"dist\": \"%s\", \"targets\": %d",
      absl::GetFlag(FLAGS_op), qps > 0 ? "open" : "closed", absl::GetFlag(FLAGS_concurrency), qps,
      absl::GetFlag(FLAGS_stream) ? "true" : "false", absl::GetFlag(FLAGS_batch),
      absl::GetFlag(FLAGS_bag), absl::GetFlag(FLAGS_dist), stubs.size());
  if (const std::string path = absl::GetFlag(FLAGS_report); !path.empty()) {
    std::ofstream(path) << ReportJson(config, stats, end - measure_from, item_name);
  }
  if (const std::string path = absl::GetFlag(FLAGS_calls_csv); !path.empty()) {
    std::ofstream(path) << stats.CallsCsv();
  }
  if (const std::string path = absl::GetFlag(FLAGS_svg); !path.empty()) {
    std::ofstream(path) << TimelineSvg(
        stats, absl::StrCat("shardserve-load ", absl::GetFlag(FLAGS_op)), item_name);
  }
  return stats.Errors().empty() ? 0 : 3;
}

}  // namespace
}  // namespace shardserve::client

int main(int argc, char** argv) { return shardserve::client::Main(argc, argv); }
