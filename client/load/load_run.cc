#include "client/load/load_run.h"

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <random>
#include <thread>

#include "absl/synchronization/blocking_counter.h"
#include "client/load/backoff.h"
#include "client/load/stream_caller.h"
#include "rpc/routing/delayer.h"

namespace shardserve::client::load {
namespace {

using rpc::Delayer;

Backoff CallerBackoff(const LoadOptions& options) {
  return Backoff(absl::Milliseconds(options.backoff_ms),
                 absl::Milliseconds(options.max_backoff_ms));
}

// Open loop: Poisson arrivals; each call's latency counts from its intended send time.
void RunOpenLoop(const LoadOptions& options, const Workload& w, LoadRouting& routing,
                 const RunWindow& window, LoadStats& stats) {
  const absl::Duration deadline = absl::Milliseconds(options.deadline_ms);
  std::mt19937_64 rng(options.seed);
  std::exponential_distribution<double> gap(options.qps);
  std::atomic<int64_t> outstanding{0};
  absl::Time intended = window.start;
  int64_t i = 0;
  while (intended < window.end) {
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
    routing.For(op).Call(w.Table(op), Workload::Method(op), bytes, intended + deadline,
                         [&, sent, items](const grpc::Status& status, grpc::ByteBuffer) {
                           stats.Record(sent, absl::Now(), status.error_code(), items);
                           --outstanding;
                         });
  }
  while (outstanding.load() > 0) absl::SleepFor(absl::Milliseconds(5));
}

// Unary closed loop: each caller is a chain of asynchronous calls (the answer to one sends the
// next), so hundreds of callers need no thread each.
void RunClosedUnary(const LoadOptions& options, const Workload& w, LoadRouting& routing,
                    const RunWindow& window, LoadStats& stats, Delayer& delayer) {
  const absl::Duration deadline = absl::Milliseconds(options.deadline_ms);
  const int callers = options.concurrency;
  const absl::Time end = window.end;
  std::atomic<int> live{callers};
  // Each touched by its caller's chain only.
  std::vector<Backoff> backoffs(callers, CallerBackoff(options));
  std::function<void(int, int64_t)> issue = [&](int c, int64_t i) {
    if (absl::Now() >= end) {
      --live;
      return;
    }
    const Op op = w.schedule[i % w.schedule.size()];
    const grpc::ByteBuffer& bytes = w.bytes.at(op)[i % w.bytes.at(op).size()];
    const absl::Time sent = absl::Now();
    const int64_t items = w.Items(op);
    routing.For(op).Call(w.Table(op), Workload::Method(op), bytes, sent + deadline,
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

// Stream closed loop: one StreamCaller per caller, on the stubs in turn.
void RunClosedStreams(const LoadOptions& options, const Workload& w,
                      const std::vector<std::shared_ptr<v1::DataService::Stub>>& stubs,
                      const RunWindow& window, LoadStats& stats, Delayer& delayer) {
  const int callers = options.concurrency;
  const int depth = std::max(1, options.pipeline);
  absl::BlockingCounter streams_done(callers);
  for (int c = 0; c < callers; ++c) {
    (new StreamCaller(w, stats, depth, c * int64_t{7919}, window.end,
                      absl::Milliseconds(options.deadline_ms), CallerBackoff(options),
                      streams_done, delayer))
        ->Begin(*stubs[c % stubs.size()]);
  }
  streams_done.Wait();
}

}  // namespace

RunWindow RunWindow::FromNow(const LoadOptions& options) {
  RunWindow window;
  window.start = absl::Now();
  window.measure_from = window.start + absl::Seconds(options.warmup_s);
  window.end = window.measure_from + absl::Seconds(options.duration_s);
  return window;
}

void RunLoad(const LoadOptions& options, const Workload& w, LoadRouting& routing,
             const std::vector<std::shared_ptr<v1::DataService::Stub>>& stubs,
             const RunWindow& window, LoadStats& stats) {
  Delayer delayer;  // the closed loops' backoffs
  std::atomic<bool> done{false};
  std::thread progress([&] {
    absl::Time next = window.start + absl::Seconds(1);
    while (!done) {
      absl::SleepFor(
          std::max(absl::ZeroDuration(), std::min(next - absl::Now(), absl::Milliseconds(100))));
      if (absl::Now() >= next) {
        if (options.progress)
          std::fprintf(stderr, "%s\n", stats.ProgressLine(absl::Now()).c_str());
        next += absl::Seconds(1);
      }
    }
  });
  if (options.qps > 0) {
    RunOpenLoop(options, w, routing, window, stats);
  } else if (!options.stream) {
    RunClosedUnary(options, w, routing, window, stats, delayer);
  } else {
    RunClosedStreams(options, w, stubs, window, stats, delayer);
  }
  done = true;
  progress.join();
}

}  // namespace shardserve::client::load
