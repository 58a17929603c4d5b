// The update message: how a step's update calls (op kUpdate) travel to every rank of the group.
// Its input message (one per rank per step, in the agreement round) carries each of the rank's
// calls whole: kind, ids, full rows of values and an optional bias. Every rank reads every rank's
// calls in rank order and applies each to its part of the table (core/table/update_log.h) - its
// columns of each row (col-wise), or the rows it owns (row-wise), and all of a linear layer's
// bias - so the group's ranks apply the same calls in the same order. Pure functions.
#ifndef SHARDSERVE_CORE_STEP_UPDATE_MESSAGE_H_
#define SHARDSERVE_CORE_STEP_UPDATE_MESSAGE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/step/step_request.h"
#include "core/table/table_config.h"
#include "core/table/update_log.h"

namespace shardserve::core {

// Appends the update message of `requests` (this rank's update calls for one table, in order).
void AppendUpdateMessage(absl::Span<StepRequest* const> requests, std::vector<int64_t>& out);
std::vector<int64_t> EmptyUpdateMessage();

// Every rank's calls, in rank order; INTERNAL for a message that does not hold what it says or
// names a row outside the table (every rank reads the same messages, so every rank fails alike).
absl::StatusOr<std::vector<std::vector<UpdateCall>>> DecodeUpdates(
    const TableConfig& table, absl::Span<const absl::Span<const char>> messages);

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_STEP_UPDATE_MESSAGE_H_
