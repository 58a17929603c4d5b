#include "core/step/log_syncer.h"

#include <map>
#include <utility>
#include <vector>

#include "core/base/process_setup.h"

namespace shardserve::core {

LogSyncer::LogSyncer(std::function<void()> progress)
    : progress_(std::move(progress)), thread_([this] {
        NameThread("wal_syncer");
        SyncLoop();
      }) {}

LogSyncer::~LogSyncer() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

void LogSyncer::Add(int64_t round, Records records) {
  absl::MutexLock lock(&mu_);
  jobs_.emplace_back(round, std::move(records));
}

int64_t LogSyncer::Synced(int64_t last_round) const {
  absl::MutexLock lock(&mu_);
  if (!failed_.ok()) return -1;
  return jobs_.empty() ? last_round : jobs_.front().first - 1;
}

absl::Status LogSyncer::failed() const {
  absl::MutexLock lock(&mu_);
  return failed_;
}

bool LogSyncer::Idle() const {
  absl::MutexLock lock(&mu_);
  return jobs_.empty();
}

void LogSyncer::WaitUntilIdle() {
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(+[](std::deque<std::pair<int64_t, Records>>* jobs) {
    return jobs->empty();
  }, &jobs_));
}

// Takes every round waiting, writes each log's records of them in order and syncs each log
// once: group commit across rounds, while the disk was busy with the last sync.
void LogSyncer::SyncLoop() {
  while (true) {
    size_t taken = 0;
    std::map<UpdateLog*, std::vector<const LogRecords*>> by_log;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_ || !jobs_.empty(); };
      mu_.Await(absl::Condition(&ready));
      if (jobs_.empty()) return;  // stopped
      taken = jobs_.size();  // they stay put: only this thread pops
      for (auto& [round, records] : jobs_) {
        for (const auto& [table, bytes] : records) by_log[table->log()].push_back(&bytes);
      }
    }
    absl::Status status;
    for (const auto& [log, records] : by_log) {
      if (absl::Status s = log->Write(records); !s.ok() && status.ok()) status = s;
    }
    {
      absl::MutexLock lock(&mu_);
      if (!status.ok() && failed_.ok()) failed_ = status;
      for (size_t i = 0; i < taken; ++i) jobs_.pop_front();
    }
    progress_();
  }
}

}  // namespace shardserve::core
