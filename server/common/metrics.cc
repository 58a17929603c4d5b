#include "server/common/metrics.h"

#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/descriptor.h"
#include "prometheus/collectable.h"
#include "prometheus/text_serializer.h"

namespace shardserve::server {
namespace {

using prometheus::ClientMetric;
using prometheus::MetricFamily;

const char* const kMethodNames[] = {"Embedding", "EmbeddingBag", "Linear", "UpdateRows"};

// process_* as the Prometheus client libraries export them, from /proc/self.
std::vector<MetricFamily> ProcessFamilies() {
  std::vector<MetricFamily> out;
  std::ifstream stat_file("/proc/self/stat");
  const std::string stat((std::istreambuf_iterator<char>(stat_file)),
                         std::istreambuf_iterator<char>());
  // Fields after the command (which may hold spaces) start at the state,
  // field 3.
  const size_t paren = stat.rfind(')');
  if (paren != std::string::npos) {
    const std::vector<std::string> f = absl::StrSplit(stat.substr(paren + 2), ' ');
    const double ticks = static_cast<double>(::sysconf(_SC_CLK_TCK));
    const double page = static_cast<double>(::sysconf(_SC_PAGESIZE));
    double utime = 0, stime = 0, start = 0, vsize = 0, rss = 0;
    if (f.size() > 21 && absl::SimpleAtod(f[11], &utime) && absl::SimpleAtod(f[12], &stime) &&
        absl::SimpleAtod(f[19], &start) && absl::SimpleAtod(f[20], &vsize) &&
        absl::SimpleAtod(f[21], &rss)) {
      MetricFamily cpu{"process_cpu_seconds_total",
                       "User and system CPU time spent in seconds.",
                       prometheus::MetricType::Counter,
                       {}};
      ClientMetric m;
      m.counter.value = (utime + stime) / ticks;
      cpu.metric.push_back(m);
      out.push_back(std::move(cpu));
      MetricFamily resident =
          GaugeFamily("process_resident_memory_bytes", "Resident memory size in bytes.");
      AddSample(resident, rss * page);
      out.push_back(std::move(resident));
      MetricFamily virt =
          GaugeFamily("process_virtual_memory_bytes", "Virtual memory size in bytes.");
      AddSample(virt, vsize);
      out.push_back(std::move(virt));
      // The start time is in ticks since boot; boot time is in /proc/stat.
      std::ifstream proc_stat("/proc/stat");
      std::string line;
      while (std::getline(proc_stat, line)) {
        double boot = 0;
        if (line.rfind("btime ", 0) == 0 && absl::SimpleAtod(line.substr(6), &boot)) {
          MetricFamily started =
              GaugeFamily("process_start_time_seconds",
                          "Start time of the process since unix epoch in seconds.");
          AddSample(started, boot + start / ticks);
          out.push_back(std::move(started));
          break;
        }
      }
    }
  }
  int fds = 0;
  if (DIR* dir = ::opendir("/proc/self/fd")) {
    while (const dirent* entry = ::readdir(dir)) {
      if (entry->d_name[0] != '.') ++fds;
    }
    ::closedir(dir);
  }
  MetricFamily open = GaugeFamily("process_open_fds", "Number of open file descriptors.");
  AddSample(open, fds - 1);  // not the directory read just now
  out.push_back(std::move(open));
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    MetricFamily max = GaugeFamily("process_max_fds", "Maximum number of open file descriptors.");
    AddSample(max, static_cast<double>(limit.rlim_cur));
    out.push_back(std::move(max));
  }
  return out;
}

}  // namespace

// GET /metrics over HTTP/1.x: one thread that answers one connection at a time,
// each within kConnectionTime (a client that sends nothing holds it no longer),
// and closes it. (Not prometheus-cpp's civetweb exposer: civetweb starts its
// threads with a small fixed stack, which pthread_create refuses in a process
// whose libraries' static TLS is larger - LibTorch's is.)
class Metrics::Endpoint {
 public:
  static constexpr int kConnectionMs = 2000;
  static constexpr size_t kMaxRequest = 8192;

  // `fd` listens (non-blocking); `stop` is a pipe whose write end ends the thread.
  Endpoint(int fd, const int stop[2], std::function<std::string()> text)
      : fd_(fd), stop_{stop[0], stop[1]}, text_(std::move(text)) {
    thread_ = std::thread([this] { Run(); });
  }
  ~Endpoint() {
    const char byte = 0;
    (void)!::write(stop_[1], &byte, 1);
    thread_.join();
    ::close(fd_);
    ::close(stop_[0]);
    ::close(stop_[1]);
  }

 private:
  void Run() {
    while (true) {
      pollfd fds[2] = {{fd_, POLLIN, 0}, {stop_[0], POLLIN, 0}};
      if (::poll(fds, 2, -1) < 0 && errno != EINTR) return;
      if (fds[1].revents != 0) return;
      if ((fds[0].revents & POLLIN) == 0) continue;
      // Non-blocking: a client that stops reading cannot hold a send past the deadline.
      const int client = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK);
      if (client < 0) {
        // Out of descriptors (EMFILE) leaves the listener readable: back off, do not spin.
        if (errno != EAGAIN && errno != EINTR) {
          pollfd stop = {stop_[0], POLLIN, 0};
          if (::poll(&stop, 1, 100) > 0) return;
        }
        continue;
      }
      Answer(client);
      ::close(client);
    }
  }

  // Reads the request head within the time allowed, and answers it.
  void Answer(int client) {
    const absl::Time deadline = absl::Now() + absl::Milliseconds(kConnectionMs);
    std::string request;
    while (request.find("\r\n\r\n") == std::string::npos &&
           request.find("\n\n") == std::string::npos) {
      const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
      pollfd in = {client, POLLIN, 0};
      if (left <= 0 || request.size() >= kMaxRequest || ::poll(&in, 1, left) <= 0) return;
      char buffer[2048];
      const ssize_t n = ::recv(client, buffer, sizeof(buffer), 0);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (n <= 0) return;
      request.append(buffer, n);
    }
    std::string status = "200 OK", body;
    const std::string line = request.substr(0, request.find_first_of("\r\n"));
    const std::vector<std::string> parts = absl::StrSplit(line, ' ');
    if (parts.size() != 3 || (parts[0] != "GET" && parts[0] != "HEAD")) {
      status = "405 Method Not Allowed";
      body = "only GET /metrics\n";
    } else if (parts[1] != "/metrics" && parts[1].rfind("/metrics?", 0) != 0) {
      status = "404 Not Found";
      body = "metrics are at /metrics\n";
    } else {
      body = text_();
    }
    std::string response = absl::StrCat(
        "HTTP/1.1 ", status, "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n",
        "Content-Length: ", body.size(), "\r\nConnection: close\r\n\r\n",
        parts.size() == 3 && parts[0] == "HEAD" ? "" : body);
    size_t sent = 0;
    while (sent < response.size()) {
      const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
      pollfd out = {client, POLLOUT, 0};
      if (left <= 0 || ::poll(&out, 1, left) <= 0) return;
      const ssize_t n =
          ::send(client, response.data() + sent, response.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
      if (n <= 0) return;
      sent += n;
    }
  }

  const int fd_;
  const int stop_[2];
  const std::function<std::string()> text_;
  std::thread thread_;
};

MetricFamily GaugeFamily(const std::string& name, const std::string& help) {
  return MetricFamily{name, help, prometheus::MetricType::Gauge, {}};
}

void AddSample(MetricFamily& family, double value, std::vector<ClientMetric::Label> labels) {
  ClientMetric m;
  m.label = std::move(labels);
  m.gauge.value = value;
  family.metric.push_back(std::move(m));
}

prometheus::Histogram::BucketBoundaries LatencyBuckets() {
  return {0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
          0.05,    0.1,    0.25,    0.5,    1,     2.5,    5,     10};
}

// The families computed at scrape time: the process's and the collectors'.
class Metrics::Collected final : public prometheus::Collectable {
 public:
  void Add(std::function<std::vector<MetricFamily>()> collect) {
    absl::MutexLock lock(&mu_);
    collectors_.push_back(std::move(collect));
  }
  std::vector<MetricFamily> Collect() const override {
    std::vector<MetricFamily> out = ProcessFamilies();
    absl::MutexLock lock(&mu_);
    for (const auto& collect : collectors_) {
      for (MetricFamily& family : collect()) out.push_back(std::move(family));
    }
    return out;
  }

 private:
  mutable absl::Mutex mu_;
  std::vector<std::function<std::vector<MetricFamily>()>> collectors_ ABSL_GUARDED_BY(mu_);
};

Metrics::Metrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      collected_(std::make_shared<Collected>()) {}

Metrics::~Metrics() = default;  // the endpoint stops first (declared last)

void Metrics::AddCollector(std::function<std::vector<MetricFamily>()> collect) {
  collected_->Add(std::move(collect));
}

absl::Status Metrics::Serve(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  int port = -1;
  if (colon == std::string::npos || colon == 0 ||
      !absl::SimpleAtoi(listen.substr(colon + 1), &port) || port < 0 || port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_listen: \"", listen, "\" is not HOST:PORT (port 0 picks a free one)"));
  }
  std::string host = listen.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
  addrinfo* found = nullptr;
  if (const int rc = ::getaddrinfo(host == "*" ? nullptr : host.c_str(),
                                   std::to_string(port).c_str(), &hints, &found);
      rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics_listen: cannot resolve \"", host, "\": ", ::gai_strerror(rc)));
  }
  int fd = -1;
  std::string why;
  for (addrinfo* a = found; a != nullptr && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 16) != 0) {
      why = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  ::freeaddrinfo(found);
  if (fd < 0) {
    return absl::UnavailableError(
        absl::StrCat("--metrics_listen: cannot listen on ", listen, ": ", why));
  }
  sockaddr_storage bound{};
  socklen_t length = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length);
  port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                            : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
  int stop[2];
  if (::pipe2(stop, O_CLOEXEC) != 0) {
    why = std::strerror(errno);
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("--metrics_listen: no pipe: ", why));
  }
  endpoint_ = std::make_unique<Endpoint>(fd, stop, [this] { return Text(); });
  return absl::OkStatus();
}

void Metrics::Stop() { endpoint_.reset(); }

std::string Metrics::Text() const {
  std::vector<MetricFamily> families = registry_->Collect();
  for (MetricFamily& family : collected_->Collect()) families.push_back(std::move(family));
  return prometheus::TextSerializer().Serialize(families);
}

CallMetrics::CallMetrics(prometheus::Registry& registry)
    : calls_(prometheus::BuildCounter()
                 .Name("shardserve_data_calls_total")
                 .Help("Data calls (unary calls, and each request of a stream) "
                       "answered by this "
                       "worker, by method, api, table and gRPC code.")
                 .Register(registry)),
      rows_(prometheus::BuildCounter()
                .Name("shardserve_table_rows_total")
                .Help("Rows served (ids looked up, or input rows of a linear "
                      "layer), by table.")
                .Register(registry)) {
  auto& latency = prometheus::BuildHistogram()
                      .Name("shardserve_data_call_duration_seconds")
                      .Help("Data calls from arrival to answer, by method and api.")
                      .Register(registry);
  for (int m = 0; m < 4; ++m) {
    for (int stream = 0; stream < 2; ++stream) {
      latency_[m * 2 + stream] = &latency.Add(
          {{"method", kMethodNames[m]}, {"api", stream ? "stream" : "unary"}}, LatencyBuckets());
    }
  }
}

CallMetrics::TableCounters& CallMetrics::For(const std::string& table) {
  auto it = tables_.find(table);
  if (it == tables_.end()) it = tables_.emplace(table, TableCounters()).first;
  return it->second;
}

void CallMetrics::Done(Method method, bool stream, const std::string& table, int code,
                       absl::Duration took) {
  const int m = static_cast<int>(method);
  latency_[m * 2 + stream]->Observe(absl::ToDoubleSeconds(took));
  code = std::clamp(code, 0, 16);
  prometheus::Counter*& counter = For(table).calls[(m * 2 + stream) * 17 + code];
  if (counter == nullptr) {
    counter = &calls_.Add({{"method", kMethodNames[m]},
                           {"api", stream ? "stream" : "unary"},
                           {"table", table},
                           {"code", std::to_string(code)}});
  }
  counter->Increment();
}

void CallMetrics::Served(const std::string& table, int64_t rows) {
  prometheus::Counter*& counter = For(table).rows;
  if (counter == nullptr) counter = &rows_.Add({{"table", table}});
  counter->Increment(static_cast<double>(rows));
}

namespace {

prometheus::Counter& OneCounter(prometheus::Registry& registry, const std::string& name,
                                const std::string& help) {
  return prometheus::BuildCounter().Name(name).Help(help).Register(registry).Add({});
}

prometheus::Histogram& OneHistogram(prometheus::Registry& registry, const std::string& name,
                                    const std::string& help,
                                    prometheus::Histogram::BucketBoundaries buckets,
                                    prometheus::Labels labels = {}) {
  return prometheus::BuildHistogram().Name(name).Help(help).Register(registry).Add(
      labels, std::move(buckets));
}

prometheus::Histogram& Phase(prometheus::Registry& registry, const char* phase) {
  return prometheus::BuildHistogram()
      .Name("shardserve_step_phase_duration_seconds")
      .Help(
          "Time of each phase of a step: agreement (the round, waiting for the "
          "peers "
          "included), compute (the ops' own work), exchange (in collectives).")
      .Register(registry)
      .Add({{"phase", phase}}, LatencyBuckets());
}

}  // namespace

StepMetrics::StepMetrics(prometheus::Registry& registry)
    : steps_(OneCounter(registry, "shardserve_steps_total",
                        "Steps of the group that carried work (on any rank).")),
      requests_(OneCounter(registry, "shardserve_step_requests_total",
                           "This rank's requests run in steps.")),
      rows_(OneCounter(registry, "shardserve_step_rows_total",
                       "Rows (ids, bags' ids, input rows) of this rank's "
                       "requests run in steps.")),
      bytes_(OneCounter(registry, "shardserve_step_input_bytes_total",
                        "Input bytes of this rank's requests run in steps.")),
      batch_(OneHistogram(registry, "shardserve_step_batch_requests",
                          "This rank's requests per step (coalescing: several per step).",
                          {0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024})),
      step_(OneHistogram(registry, "shardserve_step_duration_seconds",
                         "Steps from the agreement round to the last answer.", LatencyBuckets())),
      agreement_(Phase(registry, "agreement")),
      compute_(Phase(registry, "compute")),
      exchange_(Phase(registry, "exchange")),
      queue_wait_(OneHistogram(registry, "shardserve_queue_wait_seconds",
                               "Time requests waited from arrival until their step began.",
                               LatencyBuckets())) {}

void StepMetrics::StepDone(const core::StepStats& stats) {
  steps_.Increment();
  requests_.Increment(static_cast<double>(stats.requests));
  rows_.Increment(static_cast<double>(stats.rows));
  bytes_.Increment(static_cast<double>(stats.input_bytes));
  batch_.Observe(static_cast<double>(stats.requests));
  step_.Observe(absl::ToDoubleSeconds(stats.agreement + stats.compute + stats.exchange));
  agreement_.Observe(absl::ToDoubleSeconds(stats.agreement));
  compute_.Observe(absl::ToDoubleSeconds(stats.compute));
  exchange_.Observe(absl::ToDoubleSeconds(stats.exchange));
}

void StepMetrics::QueueWaited(absl::Duration waited) {
  queue_wait_.Observe(absl::ToDoubleSeconds(waited));
}

namespace {

// One per call: counts it when its status is sent.
class CountingInterceptor final : public grpc::experimental::Interceptor {
 public:
  CountingInterceptor(prometheus::Family<prometheus::Counter>& calls,
                      prometheus::Histogram& latency, std::string service, std::string method)
      : calls_(calls),
        latency_(latency),
        service_(std::move(service)),
        method_(std::move(method)),
        start_(absl::Now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const int code = static_cast<int>(methods->GetSendStatus().error_code());
      calls_.Add({{"service", service_}, {"method", method_}, {"code", std::to_string(code)}})
          .Increment();
      latency_.Observe(absl::ToDoubleSeconds(absl::Now() - start_));
    }
    methods->Proceed();
  }

 private:
  prometheus::Family<prometheus::Counter>& calls_;
  prometheus::Histogram& latency_;
  const std::string service_, method_;
  const absl::Time start_;
};

class CountingFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CountingFactory(prometheus::Registry& registry)
      : calls_(prometheus::BuildCounter()
                   .Name("shardserve_grpc_calls_total")
                   .Help("gRPC calls this server answered, by service, method "
                         "and code (a "
                         "stream counts once, when it ends).")
                   .Register(registry)),
        latency_(prometheus::BuildHistogram()
                     .Name("shardserve_grpc_call_duration_seconds")
                     .Help("gRPC calls from arrival to status, by service and method.")
                     .Register(registry)) {}

  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // "/pkg.Service/Method": only methods defined in this build are labelled by
    // name, so that callers cannot make up label values without bound.
    std::string service = "unknown", method = "unknown";
    const std::string path = info->method() != nullptr ? info->method() : "";
    const size_t slash = path.rfind('/');
    if (path.size() > 1 && slash != std::string::npos && slash > 0) {
      const std::string full = absl::StrCat(path.substr(1, slash - 1), ".", path.substr(slash + 1));
      if (google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(full) != nullptr) {
        service = path.substr(1, slash - 1);
        method = path.substr(slash + 1);
      }
    }
    prometheus::Histogram* latency = nullptr;
    {
      absl::MutexLock lock(&mu_);
      auto& slot = latencies_[absl::StrCat(service, "/", method)];
      if (slot == nullptr) {
        slot = &latency_.Add({{"service", service}, {"method", method}}, LatencyBuckets());
      }
      latency = slot;
    }
    return new CountingInterceptor(calls_, *latency, std::move(service), std::move(method));
  }

 private:
  prometheus::Family<prometheus::Counter>& calls_;
  prometheus::Family<prometheus::Histogram>& latency_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, prometheus::Histogram*> latencies_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
CallCountingInterceptors(prometheus::Registry& registry) {
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> out;
  out.push_back(std::make_unique<CountingFactory>(registry));
  return out;
}

}  // namespace shardserve::server
