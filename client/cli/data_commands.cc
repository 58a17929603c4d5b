#include "client/cli/data_commands.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli/json_tensor.h"
#include "rpc/security_flags.h"

ABSL_FLAG(std::string, table, "", "table of a data call");
ABSL_FLAG(uint64_t, table_version, 0,
          "data calls: the table version to use (0: the latest serving)");
ABSL_FLAG(std::string, ids, "", "ids as a JSON array");
ABSL_FLAG(std::string, ids_file, "", "file with the ids as a JSON array");
ABSL_FLAG(std::string, offsets, "", "bag offsets as a JSON array");
ABSL_FLAG(std::string, weights, "", "per_sample_weights as a JSON array");
ABSL_FLAG(std::string, mode, "mean", "bag mode: sum | mean | max");
ABSL_FLAG(bool, include_last_offset, false, "offsets end with the number of ids");
ABSL_FLAG(std::string, input, "", "linear input as a JSON array");
ABSL_FLAG(std::string, op, "", "update: assign (set the rows) or add (add deltas to them)");
ABSL_FLAG(std::string, values, "", "update: the rows (or deltas) as a JSON array [k][num_cols]");
ABSL_FLAG(std::string, bias, "", "update of a linear layer: its bias at the ids, JSON [k]");
ABSL_FLAG(std::string, input_file, "", "file with the linear input as a JSON array");
ABSL_FLAG(std::string, output, "", "write the result here instead of stdout");

namespace shardserve::client::cli {
namespace {

// The JSON array given inline (`inline_value`) or in `file`. INVALID_ARGUMENT naming --`name`
// when there is none or it does not parse; NOT_FOUND when the file cannot be read.
absl::StatusOr<JsonArray> ArrayFlag(const std::string& inline_value, const std::string& file,
                                    const std::string& name) {
  std::string text = inline_value;
  if (!file.empty()) {
    std::ifstream in(file);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", file));
    std::stringstream buffer;
    buffer << in.rdbuf();
    text = buffer.str();
  }
  if (text.empty()) return absl::InvalidArgumentError(absl::StrCat("--", name, " is required"));
  absl::StatusOr<JsonArray> array = ParseJsonArray(text);
  if (!array.ok())
    return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", array.status().message()));
  return array;
}

absl::StatusOr<v1::Tensor> IdTensor(const JsonArray& a, const std::string& name) {
  std::vector<int64_t> values;
  for (double v : a.values) {
    if (v != std::floor(v)) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", v, " is not an integer"));
    }
    values.push_back(static_cast<int64_t>(v));
  }
  return Int64Tensor(a.shape, values);
}

v1::Tensor FloatsTensor(const JsonArray& a) {
  return FloatTensor(a.shape, std::vector<float>(a.values.begin(), a.values.end()));
}

// The ids of --ids (or --ids_file) as a tensor.
absl::StatusOr<v1::Tensor> IdsFlag(const std::string& file) {
  absl::StatusOr<JsonArray> ids = ArrayFlag(absl::GetFlag(FLAGS_ids), file, "ids");
  if (!ids.ok()) return ids.status();
  return IdTensor(*ids, "ids");
}

// An answer as {"shape", "values", "version", "sequence"} on stdout or in --output.
int PrintResult(const absl::StatusOr<DenseTensor>& result) {
  if (!result.ok()) return Fail(result.status());
  const std::string json = absl::StrCat(
      "{\"shape\": [", absl::StrJoin(result->shape, ", "), "], \"values\": ",
      FormatJsonArray(result->shape, result->values),
      result->version != 0 ? absl::StrCat(", \"version\": ", result->version) : "",
      result->sequence != 0 ? absl::StrCat(", \"sequence\": ", result->sequence) : "", "}\n");
  if (const std::string path = absl::GetFlag(FLAGS_output); !path.empty()) {
    std::ofstream(path) << json;
  } else {
    std::cout << json;
  }
  return 0;
}

int EmbeddingCommand(const CommandContext& context) {
  absl::StatusOr<v1::Tensor> ids = IdsFlag(absl::GetFlag(FLAGS_ids_file));
  if (!ids.ok()) return BadUsage(ids.status());
  v1::EmbeddingRequest request;
  request.set_table(absl::GetFlag(FLAGS_table));
  request.set_version(absl::GetFlag(FLAGS_table_version));
  *request.mutable_ids() = *ids;
  return PrintResult(context.client->Embedding(request));
}

int BagCommand(const CommandContext& context) {
  absl::StatusOr<v1::Tensor> ids = IdsFlag(absl::GetFlag(FLAGS_ids_file));
  if (!ids.ok()) return BadUsage(ids.status());
  v1::EmbeddingBagRequest request;
  request.set_table(absl::GetFlag(FLAGS_table));
  request.set_version(absl::GetFlag(FLAGS_table_version));
  *request.mutable_ids() = *ids;
  if (const std::string o = absl::GetFlag(FLAGS_offsets); !o.empty()) {
    absl::StatusOr<JsonArray> offsets = ArrayFlag(o, "", "offsets");
    if (!offsets.ok()) return BadUsage(offsets.status());
    absl::StatusOr<v1::Tensor> ot = IdTensor(*offsets, "offsets");
    if (!ot.ok()) return BadUsage(ot.status());
    *request.mutable_offsets() = *ot;
  }
  if (const std::string w = absl::GetFlag(FLAGS_weights); !w.empty()) {
    absl::StatusOr<JsonArray> weights = ArrayFlag(w, "", "weights");
    if (!weights.ok()) return BadUsage(weights.status());
    *request.mutable_per_sample_weights() = FloatsTensor(*weights);
  }
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "sum" && mode != "mean" && mode != "max") {
    return BadUsage(absl::InvalidArgumentError("--mode must be sum, mean or max"));
  }
  request.set_mode(mode == "sum"   ? v1::POOL_MODE_SUM
                   : mode == "max" ? v1::POOL_MODE_MAX
                                   : v1::POOL_MODE_MEAN);
  request.set_include_last_offset(absl::GetFlag(FLAGS_include_last_offset));
  return PrintResult(context.client->EmbeddingBag(request));
}

int LinearCommand(const CommandContext& context) {
  absl::StatusOr<JsonArray> input =
      ArrayFlag(absl::GetFlag(FLAGS_input), absl::GetFlag(FLAGS_input_file), "input");
  if (!input.ok()) return BadUsage(input.status());
  v1::LinearRequest request;
  request.set_table(absl::GetFlag(FLAGS_table));
  request.set_version(absl::GetFlag(FLAGS_table_version));
  *request.mutable_input() = FloatsTensor(*input);
  return PrintResult(context.client->Linear(request));
}

// Never retried (Client::UpdateRows): a failed call may or may not have been applied.
int UpdateCommand(const CommandContext& context) {
  const std::string op = absl::GetFlag(FLAGS_op);
  if (op != "assign" && op != "add") {
    return BadUsage(absl::InvalidArgumentError("update: --op must be assign or add"));
  }
  absl::StatusOr<JsonArray> ids = ArrayFlag(absl::GetFlag(FLAGS_ids), "", "ids");
  if (!ids.ok()) return BadUsage(ids.status());
  absl::StatusOr<JsonArray> values = ArrayFlag(absl::GetFlag(FLAGS_values), "", "values");
  if (!values.ok()) return BadUsage(values.status());
  v1::UpdateRowsRequest request;
  request.set_table(absl::GetFlag(FLAGS_table));
  request.set_op(op == "assign" ? v1::ASSIGN : v1::ADD);
  absl::StatusOr<v1::Tensor> t = IdTensor(*ids, "ids");
  if (!t.ok()) return BadUsage(t.status());
  *request.mutable_ids() = *t;
  *request.mutable_values() = FloatsTensor(*values);
  if (const std::string b = absl::GetFlag(FLAGS_bias); !b.empty()) {
    absl::StatusOr<JsonArray> bias = ArrayFlag(b, "", "bias");
    if (!bias.ok()) return BadUsage(bias.status());
    *request.mutable_bias() = FloatsTensor(*bias);
  }
  absl::StatusOr<v1::UpdateRowsResponse> r = context.client->UpdateRows(request);
  if (!r.ok()) return Fail(r.status());
  std::printf("{\"version\": %llu, \"sequence\": %llu}\n",
              static_cast<unsigned long long>(r->version()),
              static_cast<unsigned long long>(r->sequence()));
  return 0;
}

}  // namespace

std::vector<Command> DataCommands() {
  // The flags of every data call: where it goes, its deadline, the table, where the answer goes.
  const std::vector<std::string> data =
      Concat({"coordinator", "deadline_ms", "via_coordinator", "table", "table_version", "output"},
             rpc::CallerSecurityFlags());
  return {
      {"embedding", "shardserve embedding --table=T --ids=JSON [flags]", "F.embedding of the ids.",
       Concat(data, {"ids", "ids_file"}), Needs::kClient, false, EmbeddingCommand},
      {"bag", "shardserve bag --table=T --ids=JSON [--offsets=JSON] [flags]",
       "F.embedding_bag of the ids (2-D ids need no offsets).",
       Concat(data, {"ids", "ids_file", "offsets", "weights", "mode", "include_last_offset"}),
       Needs::kClient, false, BagCommand},
      {"linear", "shardserve linear --table=T --input=JSON [flags]", "F.linear of the input rows.",
       Concat(data, {"input", "input_file"}), Needs::kClient, false, LinearCommand},
      {"update", "shardserve update --table=T --op=assign|add --ids=JSON --values=JSON [flags]",
       "Changes rows of T's serving version online: sets them (assign; duplicate ids: the last "
       "wins) or adds deltas (add; duplicates summed). Prints the version and its update sequence "
       "after the call; never retried (exit 64 + code: it may or may not have been applied, all "
       "of it or none).",
       Concat({"coordinator", "deadline_ms", "table", "ids", "values", "op", "bias"},
              rpc::CallerSecurityFlags()),
       Needs::kClient, false, UpdateCommand},
  };
}

}  // namespace shardserve::client::cli
