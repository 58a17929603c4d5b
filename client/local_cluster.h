// LocalCluster: a coordinator and R groups of W CPU workers as child processes on loopback - what
// `shardserve up` runs, and what the integration tests start. Workers are numbered g * W + r
// (group g, rank r): with one group, the worker number is the rank. Ports are chosen at run time
// (port 0, read back from port files) unless a coordinator port is given; every process serves
// its Prometheus metrics too, on a port of its own. Children die with the
// parent.
//
// Not thread-safe. The destructor stops every child (SIGTERM, then SIGKILL after 5 s), and removes
// the work directory if it made it (no work_dir given).
#ifndef SHARDSERVE_CLIENT_LOCAL_CLUSTER_H_
#define SHARDSERVE_CLIENT_LOCAL_CLUSTER_H_

#include <sys/types.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace shardserve::client {

struct LocalClusterOptions {
  std::string server_dir;  // holds coordinator_main and worker_main
  int groups = 1;          // replica groups
  int workers = 2;         // ranks per group
  int port = 0;            // coordinator port; 0 = any free port
  std::string work_dir;    // port files, logs and (by default) the coordinator's state; empty: a
                           // temporary directory, removed when the cluster is destroyed
  std::string state_dir;   // the registry, and every worker's update logs; empty: work_dir/state
  std::vector<std::string> coordinator_flags;
  std::vector<std::string> worker_flags;
  std::map<int, std::vector<std::string>> rank_flags;  // more flags for one worker (by number)
  bool quiet = true;       // children log to work_dir/*.log instead of stderr
  // mTLS on every port, with roles (the tokens file) and audit logs (work_dir/*.audit.log).
  bool tls = false;
  // With tls: the files deploy/make_certs.sh writes (ca.pem, coordinator.*, worker.*, client.*,
  // tokens); empty: made in work_dir/certs by server_dir/make_certs.
  std::string tls_dir;
  // The internal API on ports of its own (--internal_listen): the workers call the coordinator's,
  // the coordinator reads shards from theirs.
  bool internal_ports = false;
};

// Removes `path` and everything under it (symbolic links are removed, not followed).
void RemoveTree(const std::string& path);

class LocalCluster {
 public:
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(LocalClusterOptions options);
  ~LocalCluster();

  // Finds the directory with the server binaries next to a program (Bazel runfiles or bin tree).
  static std::string FindServerDir(const std::string& argv0);

  const std::string& work_dir() const { return options_.work_dir; }  // port files and logs
  const std::string& server_dir() const { return options_.server_dir; }
  std::string coordinator_address() const;
  // With internal_ports: where the coordinator serves the internal API (empty otherwise).
  std::string coordinator_internal_address() const;
  std::string worker_address(int rank) const;
  // Where each process serves GET /metrics (HOST:PORT).
  std::string coordinator_metrics_address() const;
  // With tls: what a caller needs - the CA that signed the servers, and a client certificate
  // with the roles read, write and admin, and its key. Empty without tls.
  std::string tls_ca() const;
  std::string tls_client_cert() const;
  std::string tls_client_key() const;
  std::string worker_metrics_address(int rank) const;
  pid_t worker_pid(int rank) const { return workers_[rank]; }  // -1 when not running
  int workers() const { return options_.workers * options_.groups; }  // over all groups
  int groups() const { return options_.groups; }
  pid_t coordinator_pid() const { return coordinator_; }  // -1 when it is not running

  // Sends `signal` and waits for the worker to exit; returns its wait status (waitpid's).
  absl::StatusOr<int> KillWorker(int rank, int signal);  // SIGKILL simulates a crash
  // Sends `signal` to a running worker (SIGSTOP / SIGCONT delay it); with SIGSTOP, returns once
  // every thread of the worker has stopped.
  absl::Status SignalWorker(int rank, int signal);
  absl::Status StartWorker(int rank);             // (re)starts a worker that is not running
  absl::Status KillCoordinator(int signal);
  absl::Status StartCoordinator();                // on the same port as before
  void Stop();

 private:
  explicit LocalCluster(LocalClusterOptions options) : options_(std::move(options)) {}
  absl::StatusOr<pid_t> Spawn(const std::string& binary, const std::vector<std::string>& args,
                              const std::string& log);
  absl::StatusOr<int> WaitForPort(const std::string& path, pid_t pid);
  // The TLS flags of the coordinator ("coordinator") or of worker N ("worker", N).
  std::vector<std::string> TlsFlags(const std::string& who, const std::string& log) const;
  // The port a process that has written its port file wrote to its metrics port file.
  static int ReadPort(const std::string& path);

  LocalClusterOptions options_;
  bool temporary_work_dir_ = false;  // made by Start: removed by the destructor
  pid_t coordinator_ = -1;
  int coordinator_port_ = 0;
  int coordinator_internal_port_ = 0;  // with internal_ports
  int coordinator_metrics_port_ = 0;
  std::vector<pid_t> workers_;
  std::vector<int> worker_ports_;
  std::vector<int> worker_metrics_ports_;
};

}  // namespace shardserve::client

#endif  // SHARDSERVE_CLIENT_LOCAL_CLUSTER_H_
