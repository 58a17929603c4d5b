#include "core/comm/rendezvous.h"

#include <fstream>
#include <sstream>
#include <string>
#include <unistd.h>

#include <cstdio>

#include "absl/strings/str_cat.h"

namespace shardserve::core {

std::string GroupEpochPrefix(uint64_t epoch) { return absl::StrCat("group/epoch-", epoch); }

absl::Status InProcessRendezvous::Set(absl::string_view key, absl::string_view value) {
  absl::MutexLock lock(&mu_);
  values_[std::string(key)] = std::string(value);
  return absl::OkStatus();
}

absl::StatusOr<std::string> InProcessRendezvous::Get(absl::string_view key,
                                                     absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  const std::string k(key);
  auto present = [this, &k]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return values_.contains(k); };
  if (!mu_.AwaitWithTimeout(absl::Condition(&present), timeout)) {
    return absl::DeadlineExceededError(absl::StrCat("rendezvous: key \"", key, "\" not set within ",
                                                    absl::FormatDuration(timeout)));
  }
  return values_[k];
}

std::string FileRendezvous::PathOf(absl::string_view key) const {
  std::string name(key);
  for (char& c : name) {
    if (c == '/') c = '_';
  }
  return absl::StrCat(directory_, "/", name);
}

absl::Status FileRendezvous::Set(absl::string_view key, absl::string_view value) {
  const std::string path = PathOf(key);
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    out.write(value.data(), static_cast<std::streamsize>(value.size()));
    if (!out) return absl::UnavailableError(absl::StrCat("rendezvous: cannot write ", tmp));
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    return absl::UnavailableError(absl::StrCat("rendezvous: cannot rename ", tmp, " to ", path));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> FileRendezvous::Get(absl::string_view key, absl::Duration timeout) {
  const std::string path = PathOf(key);
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::stringstream buffer;
      buffer << in.rdbuf();
      return buffer.str();
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "rendezvous: key \"", key, "\" not set within ", absl::FormatDuration(timeout)));
    }
    absl::SleepFor(absl::Milliseconds(2));
  }
}

}  // namespace shardserve::core
