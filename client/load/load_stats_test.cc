#include "client/load/load_stats.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardserve::client {
namespace {

using ::testing::HasSubstr;

TEST(LoadStats, PercentilesOfKnownSamples) {
  std::vector<double> samples;
  for (int i = 1; i <= 1000; ++i) samples.push_back(i);
  Percentiles p = ComputePercentiles(samples);
  EXPECT_EQ(p.count, 1000);
  EXPECT_EQ(p.p50_us, 500);
  EXPECT_EQ(p.p90_us, 900);
  EXPECT_EQ(p.p99_us, 990);
  EXPECT_EQ(p.p999_us, 999);
  EXPECT_EQ(p.max_us, 1000);
  EXPECT_DOUBLE_EQ(p.mean_us, 500.5);
}

TEST(LoadStats, WarmupIsExcludedAndErrorsCountedByCode) {
  const absl::Time t0 = absl::UnixEpoch();
  LoadStats stats(t0, t0 + absl::Seconds(1));
  stats.Record(t0, t0 + absl::Milliseconds(500), 0, 10);  // warm-up
  for (int i = 0; i < 10; ++i) {
    const absl::Time sent = t0 + absl::Seconds(1) + absl::Milliseconds(i);
    stats.Record(sent, sent + absl::Microseconds(100 * (i + 1)), 0, 512);
  }
  stats.Record(t0 + absl::Seconds(2), t0 + absl::Seconds(2), 14, 0);
  stats.Record(t0 + absl::Seconds(2), t0 + absl::Seconds(2), 14, 0);
  EXPECT_EQ(stats.calls(), 12);
  EXPECT_EQ(stats.items(), 5120);
  EXPECT_EQ(stats.Errors().at(14), 2);
  EXPECT_EQ(stats.Overall().max_us, 1000);
  const std::string json = ReportJson("\"impl\": \"x\"", stats, absl::Seconds(2), "bags");
  EXPECT_THAT(json, HasSubstr("\"errors_by_code\": {\"14\": 2}"));
  EXPECT_THAT(json, HasSubstr("\"bags_per_s\": 2560.0"));
  // Histogram: 100..1000 us in 2^(1/4) buckets, counts adding up to the OK calls.
  int64_t total = 0;
  double last = 0;
  for (const auto& [le, n] : stats.Histogram()) {
    EXPECT_GT(le, last);
    last = le;
    total += n;
  }
  EXPECT_EQ(total, 10);
  EXPECT_GE(last, 1000);
  EXPECT_THAT(json, HasSubstr("\"latency_histogram\": [{\"le_us\": "));
  const std::string svg = TimelineSvg(stats, "t", "bags");
  EXPECT_THAT(svg, HasSubstr("<polyline"));
  EXPECT_THAT(svg, HasSubstr("</svg>"));
}

}  // namespace
}  // namespace shardserve::client
