// Every row of the job settings table (src/settings.h) reaches every layer:
// the protocol, the coordinator's flags and --help, and localsgdctl status.
// (The checkpoint: CheckpointFormatTest.EverySetting_RoundTrips; the status
// page: tests/deploy/dashboard_test.py.) A setting added to the table but
// forgotten by a layer fails here.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/convert.h"
#include "src/settings.h"
#include "tests/testkit/testkit.h"

namespace localsgd {
namespace {

using ::testing::HasSubstr;
using testkit::AwaitCondition;
using testkit::TempDir;

JobSettings AllProbed() {
  JobSettings s;
  for (const JobSettingSpec& spec : JobSettingSpecs()) spec.probe(s);
  return s;
}

// stdout and stderr of `command` (run by the shell).
std::string Output(const std::string& command) {
  std::string out;
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (pipe == nullptr) return out;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0)
    out.append(buffer, n);
  pclose(pipe);
  return out;
}

TEST(SettingsLayersTest, EverySetting_RoundTripsThroughTheProtocol) {
  const JobSettings probed = AllProbed();
  v1::JobSettings proto;
  SettingsToProto(probed, &proto);
  absl::StatusOr<JobSettings> back = SettingsFromProto(proto);
  ASSERT_TRUE(back.ok()) << back.status();
  for (const JobSettingSpec& spec : JobSettingSpecs()) {
    EXPECT_TRUE(spec.equal(*back, probed))
        << spec.name << ": sent " << spec.format(probed) << ", got "
        << spec.format(*back);
  }
}

TEST(SettingsLayersTest, CoordinatorHelp_DocumentsEverySettingFlag) {
  const std::string help =
      Output(absl::StrCat(LOCALSGD_COORDINATOR, " --help"));
  for (const JobSettingSpec& spec : JobSettingSpecs()) {
    if (spec.flag == nullptr) continue;
    const size_t at = help.find(absl::StrCat("--", spec.flag, " ("));
    ASSERT_NE(at, std::string::npos) << "--help lists no --" << spec.flag;
    const size_t end = help.find(";\n", help.find("default:", at));
    EXPECT_THAT(help.substr(at, end - at),
                HasSubstr(absl::StrCat("default: \"", spec.flag_default, "\"")))
        << spec.flag;
  }
}

// The coordinator's setting flags, each set to its row's probe value,
// become the settings of a job whose first member asks for nothing.
TEST(SettingsLayersTest, CoordinatorFlags_SetEveryDefault) {
  TempDir dir;
  const JobSettings probed = AllProbed();
  std::vector<std::string> args = {
      LOCALSGD_COORDINATOR, "--listen=127.0.0.1:0",
      absl::StrCat("--port_file=", dir.File("port"))};
  for (const JobSettingSpec& spec : JobSettingSpecs()) {
    if (spec.flag == nullptr) continue;
    args.push_back(absl::StrCat("--", spec.flag, "=", spec.format(probed)));
  }
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  int port = 0;
  const bool up = AwaitCondition([&] {
    std::ifstream in(dir.File("port"));
    std::string text;
    return std::getline(in, text) && absl::SimpleAtoi(text, &port) && port > 0;
  });
  if (up) {
    ClientOptions options;
    options.target = absl::StrCat("127.0.0.1:", port);
    options.job_id = "defaults";
    options.member_name = "m";
    absl::StatusOr<std::unique_ptr<Client>> client = Client::Create(options);
    ASSERT_TRUE(client.ok()) << client.status();
    ASSERT_TRUE((*client)->Join(testkit::TestLayout(6000)).ok());
    const JobSettings& job = (*client)->info().settings;
    for (const JobSettingSpec& spec : JobSettingSpecs()) {
      if (spec.flag == nullptr) continue;
      EXPECT_TRUE(spec.equal(job, probed))
          << "--" << spec.flag << "=" << spec.format(probed)
          << " made the job's " << spec.name << " " << spec.format(job);
    }
    (*client)->Leave().IgnoreError();
  }
  kill(pid, SIGTERM);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(up) << "the coordinator did not start with " << args.size()
                  << " flags";
}

TEST(SettingsLayersTest, LocalsgdctlStatus_ShowsEverySetting) {
  auto server = testkit::StartServer(testkit::BaseServerOptions());
  ASSERT_NE(server, nullptr);
  ClientOptions options =
      testkit::BaseClientOptions(*server, "shown", "member");
  options.settings = AllProbed();
  auto client = Client::Create(options);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_TRUE((*client)->Join(testkit::TestLayout(6000)).ok());
  const std::string out =
      Output(absl::StrCat(LOCALSGD_CTL, " --target=", testkit::Target(*server),
                          " status --job=shown"));
  const JobSettings probed = AllProbed();
  for (const JobSettingSpec& spec : JobSettingSpecs()) {
    EXPECT_THAT(
        out, HasSubstr(absl::StrCat(" ", spec.name, "=", spec.format(probed))))
        << spec.name;
  }
}

}  // namespace
}  // namespace localsgd
