#include "client/local_cluster.h"

#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace shardserve::client {
namespace {

bool IsExecutable(const std::string& path) { return ::access(path.c_str(), X_OK) == 0; }

std::string Dirname(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

}  // namespace

std::string LocalCluster::FindServerDir(const std::string& argv0) {
  std::vector<std::string> candidates;
  if (const char* runfiles = std::getenv("RUNFILES_DIR")) {
    candidates.push_back(absl::StrCat(runfiles, "/shardserve/server"));
  }
  if (const char* srcdir = std::getenv("TEST_SRCDIR")) {
    candidates.push_back(absl::StrCat(srcdir, "/shardserve/server"));
  }
  candidates.push_back(argv0 + ".runfiles/shardserve/server");
  candidates.push_back(Dirname(argv0) + "/../server");
  for (const std::string& dir : candidates) {
    if (IsExecutable(dir + "/coordinator_main") && IsExecutable(dir + "/worker_main")) return dir;
  }
  return "";
}

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(LocalClusterOptions options) {
  if (options.workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--workers: ", options.workers, " must be >= 1"));
  }
  if (options.groups < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--groups: ", options.groups, " must be >= 1"));
  }
  if (options.server_dir.empty()) {
    return absl::NotFoundError("cannot find coordinator_main and worker_main (set --server_dir)");
  }
  bool temporary = false;
  if (options.work_dir.empty()) {
    char tmpl[] = "/tmp/shardserve-XXXXXX";
    if (::mkdtemp(tmpl) == nullptr) return absl::InternalError("cannot create a work directory");
    options.work_dir = tmpl;
    temporary = true;
  }
  ::mkdir(options.work_dir.c_str(), 0755);
  if (options.state_dir.empty()) options.state_dir = options.work_dir + "/state";
  ::mkdir(options.state_dir.c_str(), 0755);
  // Workers want an absolute --data_dir (they may run elsewhere than this process's directory).
  if (char* real = ::realpath(options.state_dir.c_str(), nullptr); real != nullptr) {
    options.state_dir = real;
    std::free(real);
  }
  if (options.tls && options.tls_dir.empty()) {
    options.tls_dir = options.work_dir + "/certs";
    const std::string command = absl::StrCat("'", options.server_dir, "/make_certs' '",
                                             options.tls_dir, "' >/dev/null");
    if (std::system(command.c_str()) != 0) {
      if (temporary) RemoveTree(options.work_dir);
      return absl::InternalError(absl::StrCat("cannot make certificates: ", command));
    }
  }
  std::unique_ptr<LocalCluster> cluster(new LocalCluster(options));
  cluster->temporary_work_dir_ = temporary;
  cluster->coordinator_port_ = options.port;
  cluster->workers_.assign(cluster->workers(), -1);
  cluster->worker_ports_.assign(cluster->workers(), 0);
  cluster->worker_metrics_ports_.assign(cluster->workers(), 0);
  if (absl::Status s = cluster->StartCoordinator(); !s.ok()) return s;
  for (int w = 0; w < cluster->workers(); ++w) {
    if (absl::Status s = cluster->StartWorker(w); !s.ok()) return s;
  }
  return cluster;
}

LocalCluster::~LocalCluster() {
  Stop();
  if (temporary_work_dir_) RemoveTree(options_.work_dir);
}

void RemoveTree(const std::string& path) {
  ::nftw(
      path.c_str(),
      [](const char* file, const struct stat*, int, struct FTW*) { return ::remove(file); }, 16,
      FTW_DEPTH | FTW_PHYS);
}

std::string LocalCluster::tls_ca() const {
  return options_.tls ? options_.tls_dir + "/ca.pem" : "";
}
std::string LocalCluster::tls_client_cert() const {
  return options_.tls ? options_.tls_dir + "/client.pem" : "";
}
std::string LocalCluster::tls_client_key() const {
  return options_.tls ? options_.tls_dir + "/client.key" : "";
}

std::vector<std::string> LocalCluster::TlsFlags(const std::string& who,
                                                const std::string& log) const {
  if (!options_.tls) return {};
  const std::string& dir = options_.tls_dir;
  return {absl::StrCat("--tls_cert=", dir, "/", who, ".pem"),
          absl::StrCat("--tls_key=", dir, "/", who, ".key"),
          absl::StrCat("--tls_ca=", dir, "/ca.pem"),
          absl::StrCat("--tls_client_ca=", dir, "/ca.pem"),
          absl::StrCat("--tokens_file=", dir, "/tokens"),
          absl::StrCat("--audit_log=", options_.work_dir, "/", log, ".audit.log")};
}

std::string LocalCluster::coordinator_internal_address() const {
  return options_.internal_ports ? absl::StrCat("127.0.0.1:", coordinator_internal_port_) : "";
}

std::string LocalCluster::coordinator_address() const {
  return absl::StrCat("127.0.0.1:", coordinator_port_);
}

std::string LocalCluster::worker_address(int rank) const {
  return absl::StrCat("127.0.0.1:", worker_ports_[rank]);
}

absl::StatusOr<pid_t> LocalCluster::Spawn(const std::string& binary,
                                          const std::vector<std::string>& args,
                                          const std::string& log) {
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // never outlive the cluster's owner
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);  // the owner may block signals it sigwaits for
    if (::getppid() != parent) ::_exit(1);
    if (options_.quiet) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
        ::close(fd);
      }
    }
    std::vector<char*> argv;
    argv.push_back(const_cast<char*>(binary.c_str()));
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    ::execv(binary.c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

absl::StatusOr<int> LocalCluster::WaitForPort(const std::string& path, pid_t pid) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    std::ifstream in(path);
    int port = 0;
    if (in >> port && port > 0) return port;
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      return absl::UnavailableError(absl::StrCat("process ", pid, " exited before serving (see ",
                                                 options_.work_dir, ")"));
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::DeadlineExceededError(absl::StrCat("no port in ", path, " after 30 s"));
}

int LocalCluster::ReadPort(const std::string& path) {
  std::ifstream in(path);
  int port = 0;
  in >> port;
  return port;
}

std::string LocalCluster::coordinator_metrics_address() const {
  return absl::StrCat("127.0.0.1:", coordinator_metrics_port_);
}

std::string LocalCluster::worker_metrics_address(int rank) const {
  return absl::StrCat("127.0.0.1:", worker_metrics_ports_[rank]);
}

absl::Status LocalCluster::StartCoordinator() {
  if (coordinator_ > 0) return absl::FailedPreconditionError("coordinator already running");
  const std::string port_file = options_.work_dir + "/coordinator.port";
  ::unlink(port_file.c_str());
  std::vector<std::string> args = {
      absl::StrCat("--listen=127.0.0.1:", coordinator_port_),
      absl::StrCat("--world_size=", options_.workers), absl::StrCat("--groups=", options_.groups),
      "--state_dir=" + options_.state_dir,
      "--metrics_listen=127.0.0.1:0",
      "--metrics_port_file=" + port_file + ".metrics",
      "--port_file=" + port_file};
  const std::vector<std::string> tls = TlsFlags("coordinator", "coordinator");
  args.insert(args.end(), tls.begin(), tls.end());
  if (options_.internal_ports) {  // (the same port again when it restarts)
    args.push_back(absl::StrCat("--internal_listen=127.0.0.1:", coordinator_internal_port_));
    args.push_back("--internal_port_file=" + port_file + ".internal");
  }
  args.insert(args.end(), options_.coordinator_flags.begin(), options_.coordinator_flags.end());
  absl::StatusOr<pid_t> pid = Spawn(options_.server_dir + "/coordinator_main", args,
                                    options_.work_dir + "/coordinator.log");
  if (!pid.ok()) return pid.status();
  coordinator_ = *pid;
  absl::StatusOr<int> port = WaitForPort(port_file, coordinator_);
  if (!port.ok()) return port.status();
  coordinator_port_ = *port;
  coordinator_metrics_port_ = ReadPort(port_file + ".metrics");
  if (options_.internal_ports) coordinator_internal_port_ = ReadPort(port_file + ".internal");
  return absl::OkStatus();
}

absl::Status LocalCluster::StartWorker(int rank) {
  if (rank < 0 || rank >= workers()) {
    return absl::InvalidArgumentError(absl::StrCat("worker ", rank, " out of range"));
  }
  if (workers_[rank] > 0) return absl::FailedPreconditionError("worker already running");
  const std::string port_file = absl::StrCat(options_.work_dir, "/worker", rank, ".port");
  ::unlink(port_file.c_str());
  const int coordinator_port =
      options_.internal_ports ? coordinator_internal_port_ : coordinator_port_;
  std::vector<std::string> args = {absl::StrCat("--coordinator=127.0.0.1:", coordinator_port),
                                   absl::StrCat("--group=", rank / options_.workers),
                                   absl::StrCat("--rank=", rank % options_.workers),
                                   "--listen=127.0.0.1:0", "--port_file=" + port_file,
                                   "--drain_s=0",  // stopped at once (flags below may say else)
                                   "--metrics_listen=127.0.0.1:0",
                                   "--metrics_port_file=" + port_file + ".metrics",
                                   // Update logs and snapshots, kept with the registry.
                                   absl::StrCat("--data_dir=", options_.state_dir, "/worker-g",
                                                rank / options_.workers, "-r",
                                                rank % options_.workers)};
  const std::vector<std::string> tls = TlsFlags("worker", absl::StrCat("worker", rank));
  args.insert(args.end(), tls.begin(), tls.end());
  if (options_.internal_ports) args.push_back("--internal_listen=127.0.0.1:0");
  args.insert(args.end(), options_.worker_flags.begin(), options_.worker_flags.end());
  if (auto it = options_.rank_flags.find(rank); it != options_.rank_flags.end()) {
    args.insert(args.end(), it->second.begin(), it->second.end());
  }
  absl::StatusOr<pid_t> pid = Spawn(options_.server_dir + "/worker_main", args,
                                    absl::StrCat(options_.work_dir, "/worker", rank, ".log"));
  if (!pid.ok()) return pid.status();
  workers_[rank] = *pid;
  absl::StatusOr<int> port = WaitForPort(port_file, *pid);
  if (!port.ok()) return port.status();
  worker_ports_[rank] = *port;
  worker_metrics_ports_[rank] = ReadPort(port_file + ".metrics");
  return absl::OkStatus();
}

absl::StatusOr<int> LocalCluster::KillWorker(int rank, int signal) {
  if (rank < 0 || rank >= workers() || workers_[rank] <= 0) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", rank, " is not running"));
  }
  ::kill(workers_[rank], signal);
  int wait_status = 0;
  ::waitpid(workers_[rank], &wait_status, 0);
  workers_[rank] = -1;
  return wait_status;
}

namespace {

// Whether every thread of `pid` is stopped (state T in /proc/PID/task/TID/stat).
bool AllThreadsStopped(pid_t pid) {
  const std::string tasks = absl::StrCat("/proc/", pid, "/task");
  DIR* dir = ::opendir(tasks.c_str());
  if (dir == nullptr) return false;
  bool stopped = true;
  while (const dirent* entry = ::readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    std::ifstream stat(absl::StrCat(tasks, "/", entry->d_name, "/stat"));
    std::string line;
    std::getline(stat, line);
    const size_t paren = line.rfind(')');  // the name may hold spaces and parentheses
    if (paren == std::string::npos || paren + 2 >= line.size()) continue;  // exited meanwhile
    const char state = line[paren + 2];
    stopped = stopped && (state == 'T' || state == 't');
  }
  ::closedir(dir);
  return stopped;
}

}  // namespace

absl::Status LocalCluster::SignalWorker(int rank, int signal) {
  if (rank < 0 || rank >= workers() || workers_[rank] <= 0) {
    return absl::FailedPreconditionError(absl::StrCat("worker ", rank, " is not running"));
  }
  if (::kill(workers_[rank], signal) != 0) {
    return absl::InternalError(absl::StrCat("kill(", workers_[rank], ", ", signal, ") failed"));
  }
  if (signal != SIGSTOP) return absl::OkStatus();
  // kill() returns before every thread has stopped: wait until they all have, so that a test
  // knows nothing of the worker runs any more.
  const absl::Time give_up = absl::Now() + absl::Seconds(2);
  while (absl::Now() < give_up) {
    if (AllThreadsStopped(workers_[rank])) return absl::OkStatus();
    absl::SleepFor(absl::Milliseconds(1));
  }
  return absl::DeadlineExceededError(absl::StrCat("worker ", rank, " did not stop"));
}

absl::Status LocalCluster::KillCoordinator(int signal) {
  if (coordinator_ <= 0) return absl::FailedPreconditionError("coordinator is not running");
  ::kill(coordinator_, signal);
  ::waitpid(coordinator_, nullptr, 0);
  coordinator_ = -1;
  return absl::OkStatus();
}

void LocalCluster::Stop() {
  std::vector<pid_t> all = workers_;
  all.push_back(coordinator_);
  for (pid_t pid : all) {
    if (pid > 0) ::kill(pid, SIGTERM);
  }
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  for (pid_t pid : all) {
    if (pid <= 0) continue;
    while (::waitpid(pid, nullptr, WNOHANG) == 0) {
      if (absl::Now() > deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
        break;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
  }
  workers_.assign(workers_.size(), -1);
  coordinator_ = -1;
}

}  // namespace shardserve::client
