#include "core/step/step_protocol.h"

#include <cstring>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/step/update_message.h"

namespace shardserve::core {
namespace {

// The hello starts with two words that stay as they are in every protocol: kHelloMagic, then
// the protocol (builds older than protocol 2 had no hello: their first round is an agreement);
// since protocol 3 a third word follows, the step mode (1: one request per step).
constexpr int64_t kHelloMagic = 0x70657473'64726168;  // "hardstep" in little-endian bytes

// An agreement entry: a key word (op | mode << 8 | has_weights << 16), the table name's length
// in bytes, the input message's length in words, the version (0: the latest), the name (padded
// to whole words), the message.
constexpr int64_t kEntryHeaderWords = 4;
// An agreement message starts with the digest of the rank's tables and where its update logs are
// synced to (AgreementWriter).
constexpr int64_t kHeaderWords = 2;
constexpr int64_t kMaxNameBytes = 1 << 16;

int64_t NameWords(int64_t bytes) { return (bytes + 7) / 8; }

absl::Status Malformed(size_t rank, absl::string_view what) {
  return absl::InternalError(absl::StrCat("step: the agreement message of rank ", rank, " ", what));
}

}  // namespace

WorkKey WorkKey::Of(const StepRequest& r) {
  return WorkKey{r.op, r.mode, r.has_weights, r.table, r.version};
}

InputKind WorkKey::kind() const {
  switch (op) {
    case StepRequest::Op::kEmbedding:
      return InputKind::kIds;
    case StepRequest::Op::kEmbeddingBag:
      return InputKind::kBags;
    case StepRequest::Op::kLinear:
      break;
  }
  return InputKind::kRows;
}

bool WorkKey::operator<(const WorkKey& o) const {
  return std::tie(op, mode, has_weights, table, version) <
         std::tie(o.op, o.mode, o.has_weights, o.table, o.version);
}

bool WorkKey::operator==(const WorkKey& o) const {
  return std::tie(op, mode, has_weights, table, version) ==
         std::tie(o.op, o.mode, o.has_weights, o.table, o.version);
}

std::vector<int64_t> HelloMessage(bool one_request_per_step) {
  return {kHelloMagic, kStepProtocol, one_request_per_step ? 1 : 0};
}

absl::Status CheckHellos(absl::Span<const absl::Span<const char>> hellos,
                         bool one_request_per_step) {
  const int64_t mode = one_request_per_step ? 1 : 0;
  for (size_t q = 0; q < hellos.size(); ++q) {
    int64_t theirs[3] = {0, 0, 0};
    if (hellos[q].size() == sizeof(theirs)) std::memcpy(theirs, hellos[q].data(), sizeof(theirs));
    if (hellos[q].size() == 2 * sizeof(int64_t)) std::memcpy(theirs, hellos[q].data(), 16);
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

AgreementWriter::AgreementWriter(uint64_t digest, int64_t synced)
    : words_{static_cast<int64_t>(digest), synced} {}

void AgreementWriter::Add(const WorkKey& key, absl::Span<StepRequest* const> requests) {
  const int64_t name_bytes = static_cast<int64_t>(key.table.size());
  const size_t entry = words_.size();
  words_.resize(entry + kEntryHeaderWords + NameWords(name_bytes), 0);
  words_[entry] = static_cast<int64_t>(key.op) | static_cast<int64_t>(key.mode) << 8 |
                  int64_t{key.has_weights} << 16;
  words_[entry + 1] = name_bytes;
  words_[entry + 3] = static_cast<int64_t>(key.version);
  std::memcpy(words_.data() + entry + kEntryHeaderWords, key.table.data(), name_bytes);
  const size_t at = words_.size();
  if (key.op == StepRequest::Op::kUpdate) {
    AppendUpdateMessage(requests, words_);
    words_[entry + 2] = static_cast<int64_t>(words_.size() - at);
    return;
  }
  AddInput(key, requests, entry, at);
}

void AgreementWriter::AddInput(const WorkKey& key, absl::Span<StepRequest* const> requests,
                               size_t entry, size_t at) {
  const InputKind kind = key.kind();
  int64_t num = 0, bags = 0;
  for (const StepRequest* r : requests) {
    num += static_cast<int64_t>(kind == InputKind::kRows ? r->values.size() : r->ids.size());
    if (kind == InputKind::kBags) bags += static_cast<int64_t>(r->offsets.size()) - 1;
  }
  const InputLayout l = AppendInputMessage(kind, num, bags, key.has_weights, key.mode, words_);
  words_[entry + 2] = l.words;
  int64_t* const message = words_.data() + at;
  auto* floats = reinterpret_cast<float*>(message + l.floats);
  int64_t ids = 0, offsets = 1;  // offsets[0] is 0: each request's bags follow the last's
  for (const StepRequest* r : requests) {
    if (kind == InputKind::kRows) {
      std::memcpy(floats, r->values.data(), r->values.size() * sizeof(float));
      floats += r->values.size();
      continue;
    }
    std::memcpy(message + l.ids + ids, r->ids.data(), r->ids.size() * sizeof(int64_t));
    if (kind == InputKind::kBags) {
      for (size_t b = 1; b < r->offsets.size(); ++b) {
        message[l.offsets + offsets++] = ids + r->offsets[b];
      }
      if (key.has_weights) {
        std::memcpy(floats, r->weights.data(), r->weights.size() * sizeof(float));
        floats += r->weights.size();
      }
    }
    ids += static_cast<int64_t>(r->ids.size());
  }
}

absl::Span<const char> AgreementWriter::bytes() const { return AsBytes(words_); }

absl::StatusOr<Agreement> Agreement::Read(absl::Span<const absl::Span<const char>> messages) {
  Agreement a;
  a.messages_.assign(messages.begin(), messages.end());
  a.has_work_.assign(messages.size(), false);
  const size_t world = messages.size();
  int64_t first_digest = 0;
  for (size_t q = 0; q < world; ++q) {
    const absl::Span<const char> m = messages[q];
    const auto* words = reinterpret_cast<const int64_t*>(m.data());
    const int64_t n = static_cast<int64_t>(m.size() / 8);
    if (m.size() % 8 != 0 || n < kHeaderWords || reinterpret_cast<uintptr_t>(words) % 8 != 0) {
      return Malformed(q, "is not whole aligned words");
    }
    if (q == 0) first_digest = words[0];
    a.same_tables_ = a.same_tables_ && words[0] == first_digest;
    a.synced_.push_back(words[1]);
    for (int64_t at = kHeaderWords; at < n;) {
      if (n - at < kEntryHeaderWords) return Malformed(q, "ends inside an entry");
      const int64_t k = words[at], name_bytes = words[at + 1], message_words = words[at + 2];
      const int64_t op = k & 0xff, mode = (k >> 8) & 0xff, weights = k >> 16;
      const int64_t least = op == static_cast<int64_t>(StepRequest::Op::kUpdate)
                                ? 1
                                : InputLayout::kHeaderWords;
      if (op > 3 || mode > 2 || weights > 1 || k < 0 || name_bytes < 0 ||
          name_bytes > kMaxNameBytes || message_words < least ||
          message_words > n - at - kEntryHeaderWords - NameWords(name_bytes)) {
        return Malformed(q, "has an entry that does not hold what it says");
      }
      WorkKey key;
      key.op = static_cast<StepRequest::Op>(op);
      key.mode = static_cast<PoolMode>(mode);
      key.has_weights = weights == 1;
      key.version = static_cast<uint64_t>(words[at + 3]);
      const char* name = reinterpret_cast<const char*>(words + at + kEntryHeaderWords);
      key.table.assign(name, name_bytes);
      const int64_t* input = words + at + kEntryHeaderWords + NameWords(name_bytes);
      auto& inputs = a.work_[std::move(key)];
      inputs.resize(world);
      inputs[q] = absl::Span<const char>(reinterpret_cast<const char*>(input), message_words * 8);
      a.has_work_[q] = true;
      at += kEntryHeaderWords + NameWords(name_bytes) + message_words;
    }
  }
  return a;
}

void Agreement::Own() {
  if (!owned_.empty()) return;
  owned_.resize(messages_.size());
  for (size_t q = 0; q < messages_.size(); ++q) {
    owned_[q].resize(messages_[q].size() / 8);
    if (!messages_[q].empty()) {
      std::memcpy(owned_[q].data(), messages_[q].data(), messages_[q].size());
    }
  }
  for (auto& [key, inputs] : work_) {
    for (size_t q = 0; q < inputs.size(); ++q) {
      if (inputs[q].data() == nullptr) continue;
      const size_t offset = inputs[q].data() - messages_[q].data();
      inputs[q] = absl::Span<const char>(reinterpret_cast<const char*>(owned_[q].data()) + offset,
                                         inputs[q].size());
    }
  }
  for (size_t q = 0; q < messages_.size(); ++q) messages_[q] = AsBytes(owned_[q]);
}

// Per table: the name's length in bytes, the active version, the number of loads, then (version,
// identity) per load, then the name (padded to whole words).
std::vector<int64_t> HeldTablesMessage(const TableSet& tables) {
  std::vector<int64_t> out;
  for (const auto& [name, versions] : tables.tables) {
    out.push_back(static_cast<int64_t>(name.size()));
    out.push_back(static_cast<int64_t>(versions.active));
    out.push_back(static_cast<int64_t>(versions.loads.size()));
    for (const auto& [version, table] : versions.loads) {
      out.push_back(static_cast<int64_t>(version));
      out.push_back(TableIdentity(table->config()));
    }
    const size_t at = out.size();
    out.resize(at + NameWords(static_cast<int64_t>(name.size())), 0);
    std::memcpy(out.data() + at, name.data(), name.size());
  }
  return out;
}

std::optional<uint64_t> HeldAlike::Resolve(uint64_t version) const {
  if (version != 0) {
    // A pinned version: held alike, and not staged everywhere (some rank serves it or a newer one).
    if (versions.count(version) && !active.empty() && version <= *active.rbegin()) return version;
    return std::nullopt;
  }
  for (auto it = active.rbegin(); it != active.rend(); ++it) {
    if (versions.count(*it)) return *it;
  }
  return std::nullopt;
}

absl::StatusOr<std::map<std::string, HeldAlike>> TablesHeldAlike(
    absl::Span<const absl::Span<const char>> messages) {
  // name -> version -> (identity, ranks holding it with that identity)
  std::map<std::string, std::map<uint64_t, std::pair<int64_t, size_t>>> seen;
  std::map<std::string, HeldAlike> held;
  for (size_t q = 0; q < messages.size(); ++q) {
    const auto* words = reinterpret_cast<const int64_t*>(messages[q].data());
    const int64_t n = static_cast<int64_t>(messages[q].size() / 8);
    if (messages[q].size() % 8 != 0) return Malformed(q, "(held tables) is not whole words");
    for (int64_t at = 0; at < n;) {
      if (n - at < 3 || words[at] < 0 || words[at] > kMaxNameBytes || words[at + 2] < 0 ||
          words[at + 2] > (n - at - 3) / 2 ||
          NameWords(words[at]) > n - at - 3 - 2 * words[at + 2]) {
        return Malformed(q, "(held tables) does not hold what it says");
      }
      const int64_t loads = words[at + 2];
      const int64_t* load = words + at + 3;
      std::string name(reinterpret_cast<const char*>(load + 2 * loads), words[at]);
      auto& versions = seen[name];
      HeldAlike& h = held[name];
      for (int64_t l = 0; l < loads; ++l) {
        if (load[2 * l] == words[at + 1]) h.active.insert(static_cast<uint64_t>(words[at + 1]));
        auto [it, fresh] = versions.try_emplace(static_cast<uint64_t>(load[2 * l]), load[2 * l + 1], 0);
        if (fresh || it->second.first == load[2 * l + 1]) ++it->second.second;
      }
      at += 3 + 2 * loads + NameWords(words[at]);
    }
  }
  for (const auto& [name, versions] : seen) {
    for (const auto& [version, identity] : versions) {
      if (identity.second == messages.size()) held[name].versions.insert(version);
    }
  }
  return held;
}

}  // namespace shardserve::core
