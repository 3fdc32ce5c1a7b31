#include "client/security_flags.h"

#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA bundle that signed the coordinator's certificate; set: TLS "
          "(docs/security.md)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM client certificate for mutual TLS (with --tls_key)");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_server_name, "",
          "Name to check in the coordinator's certificate instead of the host "
          "of the address connected to (e.g. when connecting by IP)");
ABSL_FLAG(std::string, token_file, "",
          "File holding the job's bearer token (a coordinator with "
          "--token_file requires one; localsgdctl status then shows that "
          "token's job)");

namespace localsgd {

absl::StatusOr<ChannelSecurity> ChannelSecurityFromFlags() {
  ChannelSecurity s;
  s.tls_ca_file = absl::GetFlag(FLAGS_tls_ca);
  s.tls_cert_file = absl::GetFlag(FLAGS_tls_cert);
  s.tls_key_file = absl::GetFlag(FLAGS_tls_key);
  s.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  s.token_file = absl::GetFlag(FLAGS_token_file);
  // The flags' names are not the fields' (--tls_ca sets tls_ca_file).
  if (absl::Status v = s.Validate([](absl::string_view field) -> std::string {
        if (field == "tls_ca_file") return "--tls_ca";
        if (field == "tls_cert_file") return "--tls_cert";
        if (field == "tls_key_file") return "--tls_key";
        return absl::StrCat("--", field);
      });
      !v.ok()) {
    return v;
  }
  return s;
}

}  // namespace localsgd
