// A member for the process-level security test (token_process_test.sh): joins
// a job with the given credentials on the real client library, seeds or
// fetches a 100-element model, syncs one round, leaves. Prints
// "ok round=<r>" and exits 0, or prints "error <CODE> <message>" and exits 1.
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/client.h"
#include "client/security_flags.h"
#include "src/layout.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Coordinator address");
ABSL_FLAG(std::string, job, "job", "Job id");
ABSL_FLAG(std::string, name, "member", "Member name");
// --token_file, --tls_ca ...: client/security_flags.h.

namespace {

int Fail(const absl::Status& status) {
  std::cout << "error " << absl::StatusCodeToString(status.code()) << " "
            << status.message() << std::endl;
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  localsgd::ClientOptions options;
  options.target = absl::GetFlag(FLAGS_target);
  options.job_id = absl::GetFlag(FLAGS_job);
  options.member_name = absl::GetFlag(FLAGS_name);
  absl::StatusOr<localsgd::ChannelSecurity> security =
      localsgd::ChannelSecurityFromFlags();
  if (!security.ok()) {
    std::fprintf(stderr, "%s\n", security.status().ToString().c_str());
    return 2;
  }
  options.security = *std::move(security);
  options.max_retry_time = absl::Seconds(5);
  auto client = localsgd::Client::Create(options);
  if (!client.ok()) return Fail(client.status());
  const localsgd::Layout layout = localsgd::MakeLayout(
      {localsgd::TensorSpec{"w", {100}, localsgd::DType::kFloat32}});
  if (absl::Status s = (*client)->Join(layout); !s.ok()) return Fail(s);
  std::vector<float> params(100, 1.0f);
  if (absl::Status s = (*client)->Initialize(absl::MakeSpan(params)); !s.ok()) {
    return Fail(s);
  }
  auto outcome = (*client)->Sync(absl::MakeSpan(params));
  if (!outcome.ok()) return Fail(outcome.status());
  if (absl::Status s = (*client)->Leave(); !s.ok()) return Fail(s);
  std::cout << "ok round=" << outcome->round << std::endl;
  return 0;
}
