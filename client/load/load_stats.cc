#include "client/load/load_stats.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace shardserve::client {
namespace {

double At(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  const size_t i = std::min(sorted.size() - 1,
                            static_cast<size_t>(std::ceil(q * sorted.size())) - (q > 0 ? 1 : 0));
  return sorted[i];
}

std::string PercentilesJson(const Percentiles& p) {
  return absl::StrFormat(
      "{\"count\": %d, \"mean_us\": %.1f, \"p50_us\": %.1f, \"p90_us\": %.1f, \"p99_us\": %.1f, "
      "\"p999_us\": %.1f, \"max_us\": %.1f}",
      p.count, p.mean_us, p.p50_us, p.p90_us, p.p99_us, p.p999_us, p.max_us);
}

}  // namespace

Percentiles ComputePercentiles(std::vector<double> samples) {
  Percentiles p;
  p.count = static_cast<int64_t>(samples.size());
  if (samples.empty()) return p;
  std::sort(samples.begin(), samples.end());
  p.p50_us = At(samples, 0.5);
  p.p90_us = At(samples, 0.9);
  p.p99_us = At(samples, 0.99);
  p.p999_us = At(samples, 0.999);
  p.max_us = samples.back();
  p.mean_us = std::accumulate(samples.begin(), samples.end(), 0.0) / samples.size();
  return p;
}

void LoadStats::Record(absl::Time sent, absl::Time done, int code, int64_t items) {
  if (done < measure_from_) return;
  const int64_t bin = (done - start_) / bin_;
  absl::MutexLock lock(&mu_);
  Bin& s = bins_[bin];
  s.t = absl::ToDoubleSeconds(bin * bin_);
  ++s.calls;
  if (code == 0) {
    s.items += items;
    latency_us_[bin].push_back(absl::ToDoubleMicroseconds(done - sent));
  } else {
    ++s.errors;
    ++errors_[code];
    failed_us_.push_back(absl::ToDoubleMicroseconds(done - sent));
  }
  if (keep_calls_) {
    calls_.push_back({static_cast<float>(absl::ToDoubleSeconds(sent - start_)),
                      static_cast<float>(absl::ToDoubleSeconds(done - start_)), code});
  }
}

void LoadStats::KeepCalls() {
  absl::MutexLock lock(&mu_);
  keep_calls_ = true;
}

std::string LoadStats::CallsCsv() const {
  absl::MutexLock lock(&mu_);
  std::string csv = "sent_s,done_s,latency_us,code\n";
  for (const Call& c : calls_) {
    absl::StrAppendFormat(&csv, "%.6f,%.6f,%.1f,%d\n", c.sent_s, c.done_s,
                          (static_cast<double>(c.done_s) - c.sent_s) * 1e6, c.code);
  }
  return csv;
}

std::vector<LoadStats::Bin> LoadStats::Timeline(bool all) const {
  absl::MutexLock lock(&mu_);
  std::vector<Bin> out;
  const int64_t last = bins_.empty() ? 0 : bins_.rbegin()->first;
  for (const auto& [bin, s] : bins_) {
    if (!all && bin == last) continue;  // still filling
    Bin copy = s;
    auto it = latency_us_.find(bin);
    if (it != latency_us_.end()) copy.latency = ComputePercentiles(it->second);
    out.push_back(copy);
  }
  return out;
}

Percentiles LoadStats::Failed() const {
  absl::MutexLock lock(&mu_);
  return ComputePercentiles(failed_us_);
}

Percentiles LoadStats::Overall() const {
  absl::MutexLock lock(&mu_);
  std::vector<double> all;
  for (const auto& [second, samples] : latency_us_)
    all.insert(all.end(), samples.begin(), samples.end());
  return ComputePercentiles(std::move(all));
}

std::vector<std::pair<double, int64_t>> LoadStats::Histogram() const {
  std::map<int, int64_t> buckets;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [second, samples] : latency_us_) {
      for (double us : samples) {
        const int b = us <= 10 ? 0 : static_cast<int>(std::ceil(4 * std::log2(us / 10)));
        ++buckets[b];
      }
    }
  }
  std::vector<std::pair<double, int64_t>> out;
  for (const auto& [b, n] : buckets) out.emplace_back(10 * std::exp2(b / 4.0), n);
  return out;
}

std::map<int, int64_t> LoadStats::Errors() const {
  absl::MutexLock lock(&mu_);
  return errors_;
}

int64_t LoadStats::calls() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [bin, s] : bins_) n += s.calls;
  return n;
}

int64_t LoadStats::items() const {
  absl::MutexLock lock(&mu_);
  int64_t n = 0;
  for (const auto& [bin, s] : bins_) n += s.items;
  return n;
}

std::string LoadStats::ProgressLine(absl::Time now) const {
  // The last complete second, from the bins that end in it.
  const int64_t second = absl::ToInt64Seconds(now - start_) - 1;
  const absl::Time from = start_ + absl::Seconds(second), to = from + absl::Seconds(1);
  absl::MutexLock lock(&mu_);
  int64_t calls = 0, items = 0, errors_now = 0;
  std::vector<double> latencies;
  for (auto it = bins_.lower_bound((from - start_) / bin_);
       it != bins_.end() && start_ + it->first * bin_ < to; ++it) {
    calls += it->second.calls;
    items += it->second.items;
    errors_now += it->second.errors;
    auto lat = latency_us_.find(it->first);
    if (lat != latency_us_.end()) {
      latencies.insert(latencies.end(), lat->second.begin(), lat->second.end());
    }
  }
  if (calls == 0) return absl::StrFormat("[%3ds] warming up / no completions", second + 1);
  const Percentiles p = ComputePercentiles(std::move(latencies));
  int64_t errors = 0;
  for (const auto& [code, n] : errors_) errors += n;
  return absl::StrFormat(
      "[%3ds] %8d calls/s  %10d items/s  errors %d (total %d)  p50 %.0f us  p99 %.0f us",
      second + 1, calls, items, errors_now, errors, p.p50_us, p.p99_us);
}

std::string ReportJson(const std::string& config, const LoadStats& stats, absl::Duration measured,
                       const std::string& item_name) {
  const double seconds = absl::ToDoubleSeconds(measured);
  std::vector<std::string> errors, timeline;
  for (const auto& [code, n] : stats.Errors())
    errors.push_back(absl::StrFormat("\"%d\": %d", code, n));
  for (const LoadStats::Bin& s : stats.Timeline()) {
    timeline.push_back(absl::StrFormat(
        "{\"t\": %g, \"calls\": %d, \"%s\": %d, \"errors\": %d, \"latency\": %s}", s.t,
        s.calls, item_name, s.items, s.errors, PercentilesJson(s.latency)));
  }
  std::vector<std::string> histogram;
  for (const auto& [le, n] : stats.Histogram()) {
    histogram.push_back(absl::StrFormat("{\"le_us\": %.1f, \"count\": %d}", le, n));
  }
  return absl::StrCat(
      "{", config, ", \"measured_s\": ", absl::StrFormat("%.3f", seconds),
      ", \"calls\": ", stats.calls(),
      absl::StrFormat(", \"calls_per_s\": %.1f, \"%s_per_s\": %.1f", stats.calls() / seconds,
                      item_name, stats.items() / seconds),
      ", \"latency\": ", PercentilesJson(stats.Overall()),
      ", \"failed_latency\": ", PercentilesJson(stats.Failed()),
      absl::StrFormat(", \"bin_s\": %g", absl::ToDoubleSeconds(stats.bin())),
      ", \"latency_histogram\": [",
      absl::StrJoin(histogram, ", "), "], \"errors_by_code\": {",
      absl::StrJoin(errors, ", "), "}, \"timeline\": [", absl::StrJoin(timeline, ", "), "]}\n");
}

std::string TimelineSvg(const LoadStats& stats, const std::string& title,
                        const std::string& item_name) {
  const std::vector<LoadStats::Bin> t = stats.Timeline();
  const double bin_s = absl::ToDoubleSeconds(stats.bin());
  const double w = 800, h = 260, left = 70, right = 20, top = 40, gap = 60;
  const double plot_w = w - left - right;
  double max_lat = 1, max_rate = 1, t0 = t.empty() ? 0 : t.front().t,
         t1 = t.empty() ? 1 : t.back().t + bin_s;
  for (const auto& s : t) {
    max_lat = std::max(max_lat, s.latency.p999_us);
    max_rate = std::max(max_rate, s.items / bin_s);
  }
  auto x = [&](double v) { return left + (v - t0) / std::max(t1 - t0, 1.0) * plot_w; };
  std::string svg = absl::StrFormat(
      "<svg xmlns='http://www.w3.org/2000/svg' width='%.0f' height='%.0f' font-family='sans-serif' "
      "font-size='12'>\n<rect width='100%%' height='100%%' fill='white'/>\n"
      "<text x='%.0f' y='20' font-size='15'>%s</text>\n",
      w, top + 2 * h + gap + 30, left, title);
  auto panel = [&](double y0, double ymax, const std::string& label,
                   const std::vector<std::pair<std::string, std::string>>& series,
                   const std::function<double(const LoadStats::Bin&, int)>& value) {
    absl::StrAppend(
        &svg, absl::StrFormat(
                  "<rect x='%.0f' y='%.0f' width='%.0f' height='%.0f' fill='none' stroke='#888'/>\n"
                  "<text x='5' y='%.0f'>%s</text>\n<text x='5' y='%.0f'>%.0f</text>\n<text x='5' "
                  "y='%.0f'>0</text>\n",
                  left, y0, plot_w, h, y0 - 6, label, y0 + 12, ymax, y0 + h));
    for (size_t k = 0; k < series.size(); ++k) {
      std::vector<std::string> points;
      for (const auto& s : t) {
        const double v = value(s, static_cast<int>(k));
        points.push_back(absl::StrFormat("%.1f,%.1f", x(s.t + bin_s / 2), y0 + h - v / ymax * h));
      }
      absl::StrAppend(&svg, absl::StrFormat(
          "<polyline fill='none' stroke='%s' stroke-width='2' points='%s'/>\n"
          "<text x='%.0f' y='%.0f' fill='%s'>%s</text>\n",
          series[k].second, absl::StrJoin(points, " "), left + 10 + 90 * k, y0 + 16,
          series[k].second, series[k].first));
    }
  };
  panel(top, max_lat * 1.05, "latency (us)",
        {{"p50", "#1f77b4"}, {"p90", "#2ca02c"}, {"p99", "#ff7f0e"}, {"p99.9", "#d62728"}},
        [](const LoadStats::Bin& s, int k) {
          return k == 0   ? s.latency.p50_us
                 : k == 1 ? s.latency.p90_us
                 : k == 2 ? s.latency.p99_us
                          : s.latency.p999_us;
        });
  panel(top + h + gap, max_rate * 1.05, item_name + " / s", {{item_name + "/s", "#9467bd"}},
        [bin_s](const LoadStats::Bin& s, int) { return s.items / bin_s; });
  absl::StrAppend(&svg, absl::StrFormat("<text x='%.0f' y='%.0f'>time (s)</text>\n</svg>\n",
                                        left + plot_w / 2, top + 2 * h + gap + 25));
  return svg;
}

}  // namespace shardserve::client
