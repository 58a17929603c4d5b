// The do-it-yourself baseline: embeddings in Redis (one binary value of D floats per row), fetched
// with MGET and pooled on the client. Closed loop with --concurrency connections; prints a result
// line and writes the same JSON report as shardserve-load.
//
//   redis_baseline --port=6399 --load --rows=100000 --dim=128     (store the rows once)
//   redis_baseline --port=6399 --op=embedding_bag --batch=512 --bag=20 --concurrency=4
#include <hiredis/hiredis.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/load/load_stats.h"
#include "core/base/process_setup.h"

ABSL_FLAG(int, port, 6399, "redis-server port on 127.0.0.1");
ABSL_FLAG(bool, load, false, "store the table (seeded values) and exit");
ABSL_FLAG(int64_t, rows, 100000, "rows");
ABSL_FLAG(int64_t, dim, 128, "floats per row");
ABSL_FLAG(std::string, op, "embedding_bag",
          "embedding_bag (MGET + client-side sum) | embedding (MGET) | mset (writes: MSET of "
          "--batch rows of new values, the do-it-yourself UpdateRows)");
ABSL_FLAG(int64_t, batch, 512, "bags (or id rows) per call");
ABSL_FLAG(int64_t, bag, 20, "ids per bag");
ABSL_FLAG(int, concurrency, 1, "connections, one caller each");
ABSL_FLAG(double, warmup_s, 1, "warm-up seconds");
ABSL_FLAG(double, duration_s, 5, "measured seconds");
ABSL_FLAG(std::string, report, "", "JSON report path");

namespace {

redisContext* Connect() {
  redisContext* c = redisConnect("127.0.0.1", absl::GetFlag(FLAGS_port));
  if (c == nullptr || c->err) {
    std::fprintf(stderr, "redis: cannot connect to 127.0.0.1:%d\n", absl::GetFlag(FLAGS_port));
    std::exit(1);
  }
  return c;
}

int Load() {
  redisContext* c = Connect();
  const int64_t rows = absl::GetFlag(FLAGS_rows), dim = absl::GetFlag(FLAGS_dim);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  std::vector<float> row(dim);
  for (int64_t i = 0; i < rows; ++i) {
    for (float& v : row) v = normal(rng);
    const std::string key = absl::StrCat("e:", i);
    redisAppendCommand(c, "SET %b %b", key.data(), key.size(), row.data(), dim * sizeof(float));
    if (i % 1000 == 999 || i == rows - 1) {
      for (int64_t k = i - i % 1000; k <= i; ++k) {
        void* reply = nullptr;
        if (redisGetReply(c, &reply) != REDIS_OK) return 1;
        freeReplyObject(reply);
      }
    }
  }
  redisFree(c);
  std::printf("stored %lld rows of %lld floats\n", static_cast<long long>(rows),
              static_cast<long long>(dim));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  shardserve::core::SetUpServingProcess();  // the same malloc settings as shardserve-load
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_load)) return Load();
  const int64_t rows = absl::GetFlag(FLAGS_rows), dim = absl::GetFlag(FLAGS_dim);
  const int64_t batch = absl::GetFlag(FLAGS_batch), bag = absl::GetFlag(FLAGS_bag);
  const bool pool = absl::GetFlag(FLAGS_op) == "embedding_bag";
  const bool mset = absl::GetFlag(FLAGS_op) == "mset";
  const absl::Time start = absl::Now();
  const absl::Time measure_from = start + absl::Seconds(absl::GetFlag(FLAGS_warmup_s));
  const absl::Time end = measure_from + absl::Seconds(absl::GetFlag(FLAGS_duration_s));
  shardserve::client::LoadStats stats(start, measure_from);
  std::atomic<int64_t> bad{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < absl::GetFlag(FLAGS_concurrency); ++t) {
    threads.emplace_back([&, t] {
      redisContext* c = Connect();
      std::mt19937_64 rng(1000 + t);
      std::uniform_int_distribution<int64_t> id(0, rows - 1);
      const int64_t n = batch * bag;
      std::vector<std::string> keys(n);
      std::vector<const char*> argv(n + 1);
      std::vector<size_t> lens(n + 1);
      std::vector<float> out(pool ? batch * dim : n * dim);
      if (mset) {  // --batch rows per MSET (--bag does not apply)
        std::uniform_real_distribution<float> value(-1, 1);
        std::vector<std::string> keys(batch), values(batch);
        std::vector<const char*> argv(2 * batch + 1);
        std::vector<size_t> lens(2 * batch + 1);
        std::vector<float> row(dim);
        while (absl::Now() < end) {
          argv[0] = "MSET";
          lens[0] = 4;
          for (int64_t i = 0; i < batch; ++i) {
            keys[i] = absl::StrCat("e:", id(rng));
            for (float& v : row) v = value(rng);
            values[i].assign(reinterpret_cast<const char*>(row.data()), dim * sizeof(float));
            argv[2 * i + 1] = keys[i].data();
            lens[2 * i + 1] = keys[i].size();
            argv[2 * i + 2] = values[i].data();
            lens[2 * i + 2] = values[i].size();
          }
          const absl::Time sent = absl::Now();
          auto* reply = static_cast<redisReply*>(
              redisCommandArgv(c, 2 * batch + 1, argv.data(), lens.data()));
          const int code = reply != nullptr && reply->type == REDIS_REPLY_STATUS ? 0 : 14;
          if (reply) freeReplyObject(reply);
          if (code) ++bad;
          stats.Record(sent, absl::Now(), code, batch);
        }
        redisFree(c);
        return;
      }
      while (absl::Now() < end) {
        argv[0] = "MGET";
        lens[0] = 4;
        for (int64_t i = 0; i < n; ++i) {
          keys[i] = absl::StrCat("e:", id(rng));
          argv[i + 1] = keys[i].data();
          lens[i + 1] = keys[i].size();
        }
        const absl::Time sent = absl::Now();
        auto* reply =
            static_cast<redisReply*>(redisCommandArgv(c, n + 1, argv.data(), lens.data()));
        int code = 0;
        if (reply == nullptr || reply->type != REDIS_REPLY_ARRAY ||
            static_cast<int64_t>(reply->elements) != n) {
          code = 14;
        } else if (pool) {  // client-side sum pooling, as a do-it-yourself service would
          std::fill(out.begin(), out.end(), 0.0f);
          for (int64_t b = 0; b < batch; ++b) {
            float* acc = &out[b * dim];
            for (int64_t j = 0; j < bag; ++j) {
              const redisReply* r = reply->element[b * bag + j];
              if (r->type != REDIS_REPLY_STRING || static_cast<int64_t>(r->len) != dim * 4) {
                code = 14;
                break;
              }
              const float* row = reinterpret_cast<const float*>(r->str);
              for (int64_t k = 0; k < dim; ++k) acc[k] += row[k];
            }
          }
        } else {
          for (int64_t i = 0; i < n; ++i) {
            const redisReply* r = reply->element[i];
            if (r->type != REDIS_REPLY_STRING) {
              code = 14;
              break;
            }
            std::memcpy(&out[i * dim], r->str, dim * 4);
          }
        }
        if (reply) freeReplyObject(reply);
        if (code) ++bad;
        stats.Record(sent, absl::Now(), code, pool ? batch : n);
      }
      redisFree(c);
    });
  }
  for (auto& t : threads) t.join();
  const double seconds = absl::ToDoubleSeconds(end - measure_from);
  const auto p = stats.Overall();
  const char* items = pool ? "bags" : mset ? "rows" : "ids";
  std::printf("redis %s: %.0f calls/s, %.0f %s/s; latency p50 %.0f us, p99 %.0f us (errors %lld)\n",
              absl::GetFlag(FLAGS_op).c_str(), stats.calls() / seconds, stats.items() / seconds,
              items, p.p50_us, p.p99_us, static_cast<long long>(bad.load()));
  if (const std::string path = absl::GetFlag(FLAGS_report); !path.empty()) {
    std::ofstream(path) << shardserve::client::ReportJson(
        absl::StrFormat("\"impl\": \"redis-mget\", \"op\": \"%s\", \"concurrency\": %d, \"batch\": "
                        "%d, \"bag\": %d",
                        absl::GetFlag(FLAGS_op), absl::GetFlag(FLAGS_concurrency), batch, bag),
        stats, end - measure_from, items);
  }
  return bad.load() == 0 ? 0 : 1;
}
