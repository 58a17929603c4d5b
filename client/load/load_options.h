// What a shardserve-load run is asked to do: its flags (client/load/load_main.cc) as a value,
// so that the run's phases - reading the tables, building the requests, the measured load, the
// report - take their settings as arguments and never read the flags themselves.
#ifndef SHARDSERVE_CLIENT_LOAD_LOAD_OPTIONS_H_
#define SHARDSERVE_CLIENT_LOAD_LOAD_OPTIONS_H_

#include <cstdint>
#include <string>

namespace shardserve::client::load {

// The defaults are the flags'; load_main.cc's flags say what each field means.
struct LoadOptions {
  // Where the calls go.
  std::string coordinator = "127.0.0.1:50051";
  std::string target;  // one address only (skips the placement map)
  bool via_coordinator = false;
  // The requests.
  std::string table;         // embedding, embedding_bag, update
  std::string linear_table;  // linear
  std::string op = "embedding_bag";  // embedding | embedding_bag | linear | update | mix
  std::string mix = "embedding_bag=0.8,embedding=0.1,linear=0.1";
  int64_t batch = 512;
  int64_t bag = 20;
  double update_fraction = 0;
  int64_t update_rows = 512;
  std::string mode = "sum";
  std::string dist = "uniform";
  double zipf = 1.1;
  uint64_t seed = 1;
  // With --target, the tables' shapes (else read from the placement maps).
  int64_t rows = 0;  // the embedding table's num_rows
  int64_t cols = 0;  // the linear layer's in_features
  int64_t dim = 0;   // the embedding table's embedding_dim
  // The load.
  int concurrency = 1;  // closed loop
  double qps = 0;       // open loop when > 0
  bool stream = false;
  int pipeline = 1;
  double warmup_s = 2;
  double duration_s = 10;
  int deadline_ms = 5000;
  int backoff_ms = 1;
  int max_backoff_ms = 100;
  int hedge_ms = 50;
  int max_attempts = 8;
  // The report.
  std::string report;
  std::string svg;
  std::string calls_csv;
  bool progress = true;
  int timeline_ms = 1000;
};

}  // namespace shardserve::client::load

#endif  // SHARDSERVE_CLIENT_LOAD_LOAD_OPTIONS_H_
