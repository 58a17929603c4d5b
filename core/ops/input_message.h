// The input message of a sharded op: what each rank sends its peers of its input for one op in a
// step (ids, bags and per-sample weights, or linear input rows), as int64 words, and how every
// rank reads every rank's message back (GatheredInputs), checked where a bad message could make
// a rank read or write outside its buffers.
//
// Layout: three header words - the number of ids (or of input values, for linear), the number
// of bags (-1: not bagged), flags (bit 0: per-sample weights; bits 1..: the pool mode) - then the
// ids, the bag offsets (bags + 1 words: canonical, from 0 to the number of ids), and the weights
// or input values as floats, two to a word. A rank without input sends an empty message (no ids,
// zero bags), which contributes nothing and renorms nothing.
//
// Pure functions; thread-safe.
#ifndef SHARDSERVE_CORE_OPS_INPUT_MESSAGE_H_
#define SHARDSERVE_CORE_OPS_INPUT_MESSAGE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/kernels/local_kernels.h"
#include "core/ops/op_inputs.h"
#include "core/table/table_config.h"

namespace shardserve::core {

enum class InputKind { kIds, kBags, kRows };

// Where each part of a message lies, in words from its start.
struct InputLayout {
  static constexpr int64_t kHeaderWords = 3;
  int64_t ids = 0;      // kIds, kBags
  int64_t offsets = 0;  // kBags
  int64_t floats = 0;   // kBags with weights (the weights), kRows (the input values)
  int64_t words = 0;    // the whole message

  // `num`: ids (kIds, kBags) or input values (kRows).
  static InputLayout Of(InputKind kind, int64_t num, int64_t num_bags, bool has_weights);
};

// Appends a message's words to `out` (header written, body zeroed) and returns its layout, relative
// to where it starts in `out`: the caller writes the body.
InputLayout AppendInputMessage(InputKind kind, int64_t num, int64_t num_bags, bool has_weights,
                               PoolMode mode, std::vector<int64_t>& out);

// The message of one valid input (validated against its table before), or of none.
std::vector<int64_t> EncodeInput(const EmbeddingInput& input);
std::vector<int64_t> EncodeInput(const EmbeddingBagInput& input, const CanonicalBags& bags);
std::vector<int64_t> EncodeInput(const LinearInput& input);
std::vector<int64_t> EmptyInput(InputKind kind, PoolMode mode = PoolMode::kSum);

// One rank's input as every rank reads it: views into the message.
struct InputSource {
  int64_t num_ids = 0;   // ids, or input rows (kRows)
  int64_t num_bags = 0;  // kBags
  PoolMode mode = PoolMode::kSum;
  const int64_t* ids = nullptr;
  const int64_t* offsets = nullptr;  // num_bags + 1 entries
  const float* weights = nullptr;    // per-sample weights, or null
  const float* rows = nullptr;       // kRows: num_ids x table.num_cols values
};

// Every rank's input for one op, in rank order: the same on every rank.
struct GatheredInputs {
  std::vector<InputSource> sources;

  int world() const { return static_cast<int>(sources.size()); }
  std::vector<int64_t> NumIds() const;   // per rank (input rows for kRows)
  std::vector<int64_t> NumBags() const;  // per rank
};

// Reads every rank's message (rank order, 8-byte aligned) for an op of `kind` on `table`. Each
// is checked against itself and the table - sizes within the message, ids in [0, num_rows),
// offsets canonical, input values whole rows of num_cols - so that no message can make a rank
// read or write outside its buffers: INTERNAL otherwise (every rank reads the same messages, so
// every rank fails alike). The views stay valid as long as the messages.
absl::StatusOr<GatheredInputs> DecodeInputs(InputKind kind, const TableConfig& table,
                                            absl::Span<const absl::Span<const char>> messages);

}  // namespace shardserve::core

#endif  // SHARDSERVE_CORE_OPS_INPUT_MESSAGE_H_
