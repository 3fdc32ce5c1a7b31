// Helpers of the security tests: certificates made with the openssl CLI,
// and the shared test kit (tests/testkit/testkit.h: an in-process
// coordinator on loopback, a raw protocol client that plays honest or
// hostile members).
#ifndef LOCALSGD_TESTS_SECURITY_SECURITY_UTIL_H_
#define LOCALSGD_TESTS_SECURITY_SECURITY_UTIL_H_

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "tests/testkit/testkit.h"

#ifndef LOCALSGD_OPENSSL
#define LOCALSGD_OPENSSL "openssl"
#endif

namespace localsgd {
namespace security_test {

using namespace ::localsgd::testkit;  // NOLINT: the kit, unqualified

// Certificates for the TLS tests, made once per process with the openssl
// CLI (EC P-256 keys: fast):
//   ca.pem            test CA
//   server.pem/.key   signed by ca, SAN DNS:localhost, IP:127.0.0.1
//   client_a.*        signed by ca, subject CN=worker-a
//   client_b.*        signed by ca, subject CN=worker-b
//   other_ca.pem      another CA
//   other_client.*    signed by other_ca, CN=worker-a (same name, wrong CA)
//   other_server.*    signed by other_ca, SAN localhost/127.0.0.1
//   coordinator.*     signed by ca, SAN localhost/127.0.0.1, for serverAuth
//                     and clientAuth (a standby presents it to its primary)
class Certs {
 public:
  // Empty error: made. Otherwise what failed.
  static const Certs& Get() {
    static Certs* certs = new Certs();
    return *certs;
  }
  const std::string& error() const { return error_; }
  std::string Path(const std::string& name) const { return dir_.File(name); }

 private:
  Certs() {
    const std::string script = absl::StrCat(
        "set -e; cd '", dir_.path(), "'; O='", LOCALSGD_OPENSSL, "'\n",
        R"(key() { "$O" genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1.key" 2>/dev/null; }
ca() {  # name subject
  key "$1"
  "$O" req -x509 -new -key "$1.key" -out "$1.pem" -days 2 -subj "$2" \
    -addext basicConstraints=critical,CA:TRUE \
    -addext keyUsage=critical,keyCertSign,cRLSign 2>/dev/null
}
leaf() {  # name subject ca extensions
  key "$1"
  "$O" req -new -key "$1.key" -out "$1.csr" -subj "$2" 2>/dev/null
  printf '%b' "$4" > "$1.ext"
  "$O" x509 -req -in "$1.csr" -CA "$3.pem" -CAkey "$3.key" -CAcreateserial \
    -out "$1.pem" -days 2 -extfile "$1.ext" 2>/dev/null
}
SERVER='basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n'
BOTH='basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n'
CLIENT='basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n'
ca ca "/CN=localsgd test CA"
ca other_ca "/CN=localsgd other CA"
leaf server "/CN=localhost" ca "$SERVER"
leaf client_a "/O=localsgd/CN=worker-a" ca "$CLIENT"
leaf client_b "/O=localsgd/CN=worker-b" ca "$CLIENT"
leaf other_client "/O=localsgd/CN=worker-a" other_ca "$CLIENT"
leaf other_server "/CN=localhost" other_ca "$SERVER"
leaf coordinator "/CN=localhost" ca "$BOTH"
)");
    const std::string script_path = dir_.Write("make.sh", script);
    const int rc =
        std::system(absl::StrCat("bash '", script_path, "'").c_str());
    if (rc != 0) {
      error_ = absl::StrCat("making certificates with ", LOCALSGD_OPENSSL,
                            " failed (", rc, "); see ", script_path);
    }
  }
  TempDir dir_;
  std::string error_;
};

}  // namespace security_test
}  // namespace localsgd

#endif  // LOCALSGD_TESTS_SECURITY_SECURITY_UTIL_H_
