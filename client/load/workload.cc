#include "client/load/workload.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/client.h"
#include "grpcpp/impl/codegen/proto_utils.h"

namespace shardserve::client::load {
namespace {

// Ids from a uniform or Zipf distribution; Zipf's popular ids are scattered over the table.
class IdSource {
 public:
  IdSource(int64_t n, bool zipf, double alpha, uint64_t seed) : n_(n), zipf_(zipf), rng_(seed) {
    if (!zipf_) return;
    cdf_.resize(n);
    double total = 0;
    for (int64_t k = 0; k < n; ++k) cdf_[k] = (total += 1.0 / std::pow(k + 1.0, alpha));
    for (double& c : cdf_) c /= total;
  }
  int64_t Next() {
    if (!zipf_) return std::uniform_int_distribution<int64_t>(0, n_ - 1)(rng_);
    const double u = std::uniform_real_distribution<double>(0, 1)(rng_);
    const int64_t rank = std::lower_bound(cdf_.begin(), cdf_.end(), u) - cdf_.begin();
    return static_cast<int64_t>(
        (static_cast<unsigned __int128>(std::min(rank, n_ - 1)) * 2654435761u) % n_);
  }

 private:
  int64_t n_;
  bool zipf_;
  std::mt19937_64 rng_;
  std::vector<double> cdf_;
};

// Each op's weight in the mix, --update_fraction's updates added.
absl::StatusOr<std::map<Op, double>> OpWeights(const LoadOptions& options) {
  std::map<Op, double> weights;
  const std::map<std::string, Op> names = {{"embedding", Op::kEmbedding},
                                           {"embedding_bag", Op::kBag},
                                           {"linear", Op::kLinear},
                                           {"update", Op::kUpdate}};
  if (options.op == "mix") {
    for (absl::string_view part : absl::StrSplit(options.mix, ',')) {
      std::vector<std::string> kv = absl::StrSplit(part, '=');
      double weight = 0;
      if (kv.size() != 2 || !names.count(kv[0]) || !absl::SimpleAtod(kv[1], &weight) ||
          weight < 0) {
        return absl::InvalidArgumentError(absl::StrCat("--mix: bad entry \"", part, "\""));
      }
      weights[names.at(kv[0])] = weight;
    }
  } else if (names.count(options.op)) {
    weights[names.at(options.op)] = 1;
  } else {
    return absl::InvalidArgumentError(
        "--op must be embedding, embedding_bag, linear, update or mix");
  }
  if (const double f = options.update_fraction; f > 0) {
    if (f >= 1) return absl::InvalidArgumentError("--update_fraction must be in [0, 1)");
    double reads = 0;
    for (const auto& [o, weight] : weights) reads += weight;
    weights[Op::kUpdate] += reads * f / (1 - f);
  }
  return weights;
}

}  // namespace

const char* Workload::Method(Op op) {
  return op == Op::kEmbedding ? "/shardserve.v1.DataService/Embedding"
         : op == Op::kBag     ? "/shardserve.v1.DataService/EmbeddingBag"
         : op == Op::kUpdate  ? "/shardserve.v1.DataService/UpdateRows"
                              : "/shardserve.v1.DataService/Linear";
}

const std::string& Workload::Table(Op op) const {
  return op == Op::kLinear ? linear_table : table;
}

int64_t Workload::Items(Op op) const {
  if (op == Op::kUpdate) return update_rows;
  return op == Op::kEmbedding ? batch * bag : batch;
}

absl::StatusOr<Workload> BuildWorkload(const LoadOptions& options, const TableShape& shape) {
  Workload w;
  w.table = options.table;
  w.linear_table = options.linear_table;
  w.batch = options.batch;
  w.bag = options.bag;
  w.update_rows = options.update_rows;
  absl::StatusOr<std::map<Op, double>> weights = OpWeights(options);
  if (!weights.ok()) return weights.status();
  const int64_t dim = shape.dim, in_features = shape.in_features;
  if (weights->count(Op::kUpdate) && (dim <= 0 || options.update_rows <= 0)) {
    return absl::InvalidArgumentError(
        "updates need --table's embedding_dim (--dim with --target) and --update_rows >= 1");
  }
  for (const auto& [o, weight] : *weights) {
    for (int k = 0; k < static_cast<int>(std::lround(weight * 100)); ++k) w.schedule.push_back(o);
  }
  if (w.schedule.empty()) return absl::InvalidArgumentError("--mix: all weights are zero");
  std::shuffle(w.schedule.begin(), w.schedule.end(), std::mt19937(options.seed));
  const int64_t batch = options.batch, bag = options.bag;
  const std::string& mode = options.mode;
  IdSource ids(std::max<int64_t>(shape.rows, 1), options.dist == "zipf", options.zipf,
               options.seed);
  std::mt19937 rng(options.seed);
  std::uniform_real_distribution<float> value(-1, 1);
  constexpr int kPool = 16;
  for (const auto& [o, weight] : *weights) {
    for (int k = 0; k < kPool; ++k) {
      v1::StreamRequest r;
      if (o == Op::kUpdate) {
        const int64_t n = options.update_rows;
        std::vector<int64_t> id(n);
        for (int64_t& v : id) v = ids.Next();
        std::vector<float> delta(n * dim);
        for (float& v : delta) v = value(rng) * 1e-3f;  // a trainer's small scaled gradient
        v1::UpdateRowsRequest* u = r.mutable_update_rows();
        u->set_table(options.table);
        u->set_op(v1::ADD);
        *u->mutable_ids() = Int64Tensor({n}, id);
        *u->mutable_values() = FloatTensor({n, dim}, delta);
      } else if (o == Op::kLinear) {
        std::vector<float> x(batch * in_features);
        for (float& v : x) v = value(rng);
        r.mutable_linear()->set_table(options.linear_table);
        *r.mutable_linear()->mutable_input() = FloatTensor({batch, in_features}, x);
      } else {
        std::vector<int64_t> id(batch * bag);
        for (int64_t& v : id) v = ids.Next();
        if (o == Op::kEmbedding) {
          r.mutable_embedding()->set_table(options.table);
          *r.mutable_embedding()->mutable_ids() = Int64Tensor({batch, bag}, id);
        } else {
          r.mutable_embedding_bag()->set_table(options.table);
          *r.mutable_embedding_bag()->mutable_ids() = Int64Tensor({batch, bag}, id);
          r.mutable_embedding_bag()->set_mode(mode == "mean"  ? v1::POOL_MODE_MEAN
                                              : mode == "max" ? v1::POOL_MODE_MAX
                                                              : v1::POOL_MODE_SUM);
        }
      }
      grpc::ByteBuffer bytes;
      bool own = false;
      const google::protobuf::Message& m =
          o == Op::kUpdate      ? static_cast<const google::protobuf::Message&>(r.update_rows())
          : o == Op::kLinear    ? static_cast<const google::protobuf::Message&>(r.linear())
          : o == Op::kEmbedding ? static_cast<const google::protobuf::Message&>(r.embedding())
                                : static_cast<const google::protobuf::Message&>(r.embedding_bag());
      if (!grpc::SerializationTraits<google::protobuf::Message>::Serialize(m, &bytes, &own).ok()) {
        return absl::InternalError("cannot serialize a request");
      }
      w.bytes[o].push_back(std::move(bytes));
      w.pool[o].push_back(std::move(r));
    }
  }
  return w;
}

}  // namespace shardserve::client::load
