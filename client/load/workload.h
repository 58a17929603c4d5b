// The requests a shardserve-load run sends: the ops in their mix's proportion and a small pool of
// pre-built requests per op (ids uniform or Zipf, random inputs and update deltas), built once so
// that generating load costs the client nothing per call.
#ifndef SHARDSERVE_CLIENT_LOAD_WORKLOAD_H_
#define SHARDSERVE_CLIENT_LOAD_WORKLOAD_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/load/load_options.h"
#include "grpcpp/support/byte_buffer.h"
#include "proto/shardserve.pb.h"

namespace shardserve::client::load {

enum class Op { kEmbedding, kBag, kLinear, kUpdate };

// The tables' shapes the requests are built for.
struct TableShape {
  int64_t rows = 0;         // the embedding table's num_rows (ids are drawn from [0, rows))
  int64_t in_features = 0;  // the linear layer's
  int64_t dim = 0;          // the embedding table's embedding_dim (update deltas)
};

// Immutable once built; shared by every caller without a lock.
struct Workload {
  std::vector<Op> schedule;  // ops in mix proportion, cycled
  std::map<Op, std::vector<v1::StreamRequest>> pool;  // pre-built requests per op
  std::map<Op, std::vector<grpc::ByteBuffer>> bytes;  // the same, serialized for unary calls
  std::string table, linear_table;
  int64_t batch = 0, bag = 0, update_rows = 0;

  // The DataService method of `op`'s unary calls.
  static const char* Method(Op op);
  // The table `op`'s calls name.
  const std::string& Table(Op op) const;
  // What one call of `op` carries (bags, ids or rows), for the item rate.
  int64_t Items(Op op) const;
};

// The requests --op (or --mix) and --update_fraction ask for, on tables of `shape`.
// INVALID_ARGUMENT for a bad --op, --mix or --update_fraction, or updates without the table's
// embedding_dim; INTERNAL when a request cannot be serialized.
absl::StatusOr<Workload> BuildWorkload(const LoadOptions& options, const TableShape& shape);

}  // namespace shardserve::client::load

#endif  // SHARDSERVE_CLIENT_LOAD_WORKLOAD_H_
