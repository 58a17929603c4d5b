#include "rpc/cli.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "rpc/logging.h"
#include "rpc/security_flags.h"

ABSL_FLAG(int, v, 0, "log verbosity: VLOG(n) lines with n <= v are written too");

// From the generated build_commit.cc (//server:build_commit, stamped by Bazel).
extern const char kShardserveCommit[];

namespace shardserve::rpc {
namespace {

constexpr const char kVersion[] = "0.7.0";

std::string Basename(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// `text` wrapped at 96 columns, each line indented by `indent`.
std::string Wrap(const std::string& text, int indent) {
  std::string out, line;
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    if (!line.empty() && line.size() + 1 + word.size() + indent > 96) {
      absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
      line.clear();
    }
    absl::StrAppend(&line, line.empty() ? "" : " ", word);
  }
  if (!line.empty()) absl::StrAppend(&out, std::string(indent, ' '), line, "\n");
  return out;
}

void PrintHelp(const Usage& usage) {
  std::string out = absl::StrCat("usage: ", usage.synopsis, "\n");
  if (!usage.description.empty()) absl::StrAppend(&out, "\n", Wrap(usage.description, 2));
  std::vector<absl::CommandLineFlag*> flags;
  if (!usage.flags.empty()) {
    for (const std::string& name : usage.flags) {
      if (absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name)) flags.push_back(flag);
    }
  } else {
    for (const auto& [name, flag] : absl::GetAllFlags()) {
      // (and the security flags every binary shares)
      if ((!usage.flags_file.empty() && absl::EndsWith(flag->Filename(), usage.flags_file)) ||
          absl::EndsWith(flag->Filename(), kSecurityFlagsFile)) {
        flags.push_back(flag);
      }
    }
    std::sort(flags.begin(), flags.end(), [](absl::CommandLineFlag* a, absl::CommandLineFlag* b) {
      return a->Name() < b->Name();
    });
  }
  absl::StrAppend(&out, "\nflags:\n");
  for (absl::CommandLineFlag* flag : flags) {
    std::string value = flag->DefaultValue();
    if (flag->IsOfType<std::string>()) value = absl::StrCat("\"", value, "\"");
    absl::StrAppend(&out, "  --", flag->Name(), " (default: ", value, ")\n", Wrap(flag->Help(), 6));
  }
  if (usage.flags.empty()) {  // a server: its log's verbosity too
    absl::StrAppend(&out, "  --v (default: 0)\n", Wrap(absl::FindCommandLineFlag("v")->Help(), 6));
  }
  absl::StrAppend(&out, "  --help, -h\n      this text\n  --version\n",
                  "      the version and the commit it was built from\n");
  std::fputs(out.c_str(), stdout);
}

bool IsBool(const absl::CommandLineFlag& flag) { return flag.IsOfType<bool>(); }

}  // namespace

std::vector<std::string> ParseFlags(
    int argc, char** argv, const std::function<Usage(const std::vector<std::string>&)>& usage) {
  const std::string program = Basename(argc > 0 ? argv[0] : "shardserve");
  std::vector<std::string> args = {argc > 0 ? argv[0] : program};
  bool help = false, version = false, flags_done = false;
  std::vector<std::string> errors;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (flags_done || arg.size() < 2 || arg[0] != '-') {
      args.push_back(arg);
      continue;
    }
    if (arg == "--") {
      flags_done = true;
      continue;
    }
    absl::string_view body = absl::StripPrefix(absl::StripPrefix(arg, "-"), "-");
    const size_t eq = body.find('=');
    const std::string name(body.substr(0, eq));
    if (name == "help" || name == "h" || name == "helpfull") {
      help = true;
      continue;
    }
    if (name == "version") {
      version = true;
      continue;
    }
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    // --noX is X=false for a bool flag X, and nothing else.
    absl::CommandLineFlag* negated =
        flag == nullptr && absl::StartsWith(name, "no") ? absl::FindCommandLineFlag(name.substr(2))
                                                        : nullptr;
    if (negated != nullptr && !IsBool(*negated)) negated = nullptr;
    std::string value;
    if (eq != absl::string_view::npos) {
      value = std::string(body.substr(eq + 1));
      if (negated != nullptr) flag = nullptr;  // --noX=value: unknown
    } else if (flag != nullptr && IsBool(*flag)) {
      value = "true";
    } else if (negated != nullptr) {
      flag = negated;
      value = "false";
    } else if (flag != nullptr && i + 1 < argc) {
      value = argv[++i];
    } else if (flag != nullptr) {
      errors.push_back(absl::StrCat("--", name, " needs a value"));
      continue;
    }
    if (flag == nullptr || flag->IsRetired()) {
      errors.push_back(absl::StrCat("unknown flag --", name, " (see --help)"));
      continue;
    }
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      errors.push_back(absl::StrCat("--", name, "=", value, ": ", error));
    }
  }
  if (version) {
    std::printf("%s\n", VersionLine().c_str());
    std::exit(0);
  }
  if (help) {
    PrintHelp(usage(args));
    std::exit(0);
  }
  InitLogging(argv[0], absl::GetFlag(FLAGS_v));
  if (!errors.empty()) {
    for (const std::string& e : errors)
      std::fprintf(stderr, "%s: %s\n", program.c_str(), e.c_str());
    std::exit(kExitUsage);
  }
  return args;
}

std::string VersionLine() {
  return absl::StrCat("shardserve ", kVersion, " (commit ", kShardserveCommit, ")");
}

int ExitCodeOf(const absl::Status& status) {
  return status.ok() ? 0 : kExitGrpcBase + static_cast<int>(status.code());
}

int UsageError(const std::string& program, const std::string& message) {
  std::fprintf(stderr, "%s: %s\n", program.c_str(), message.c_str());
  return kExitUsage;
}

}  // namespace shardserve::rpc
