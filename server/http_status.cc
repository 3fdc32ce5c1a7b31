#include "server/http_status.h"

#include <civetweb.h>

#include <cstring>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "glog/logging.h"
#include "google/protobuf/util/json_util.h"
#include "localsgd/v1/coordinator.pb.h"
#include "server/protocol.h"

namespace localsgd {
namespace {

int HttpStatusOf(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kOk:
      return 200;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return 400;
    case absl::StatusCode::kUnauthenticated:
      return 401;
    case absl::StatusCode::kPermissionDenied:
      return 403;
    case absl::StatusCode::kNotFound:
      return 404;
    case absl::StatusCode::kUnimplemented:
      return 405;
    case absl::StatusCode::kUnavailable:
      return 503;
    default:
      return 500;
  }
}

const char* ReasonPhrase(int http_status) {
  switch (http_status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 401:
      return "Unauthorized";
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 503:
      return "Service Unavailable";
    default:
      return "Internal Server Error";
  }
}

// Writes a whole response; `extra_headers` are complete lines ("Name:
// value\r\n"). HEAD gets the headers only. Returns the status (civetweb's
// "handled").
int Respond(mg_connection* conn, int http_status, absl::string_view type,
            absl::string_view body, absl::string_view extra_headers = "") {
  const mg_request_info* info = mg_get_request_info(conn);
  const bool head = info != nullptr && info->request_method != nullptr &&
                    std::strcmp(info->request_method, "HEAD") == 0;
  const std::string header = absl::StrCat(
      "HTTP/1.1 ", http_status, " ", ReasonPhrase(http_status), "\r\n",
      "Content-Type: ", type, "\r\n", "Content-Length: ", body.size(), "\r\n",
      "Cache-Control: no-store\r\n", "X-Content-Type-Options: nosniff\r\n",
      extra_headers, "Connection: close\r\n\r\n");
  mg_write(conn, header.data(), header.size());
  if (!head && !body.empty()) mg_write(conn, body.data(), body.size());
  return http_status;
}

std::string JsonEscape(absl::string_view s) {
  std::string out;
  out.reserve(s.size() + 2);
  for (const char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        // Control characters and every non-ASCII byte as \u00XX: the
        // message may echo a request's bytes, and the body must stay UTF-8.
        if (static_cast<unsigned char>(c) < 0x20 ||
            static_cast<unsigned char>(c) >= 0x7f) {
          absl::StrAppend(
              &out, "\\u00",
              absl::Hex(static_cast<unsigned char>(c), absl::kZeroPad2));
        } else {
          out += c;
        }
    }
  }
  return out;
}

// Query parameters, URL-decoded. INVALID_ARGUMENT for an unknown or
// repeated one.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> ParseQuery(
    const char* query) {
  std::vector<std::pair<std::string, std::string>> params;
  if (query == nullptr || *query == '\0') return params;
  for (absl::string_view part : absl::StrSplit(query, '&', absl::SkipEmpty())) {
    std::pair<absl::string_view, absl::string_view> kv =
        absl::StrSplit(part, absl::MaxSplits('=', 1));
    std::string key(kv.first.size() + 1, '\0');
    std::string value(kv.second.size() + 1, '\0');
    const int klen =
        mg_url_decode(kv.first.data(), static_cast<int>(kv.first.size()),
                      key.data(), static_cast<int>(key.size()), 1);
    const int vlen =
        mg_url_decode(kv.second.data(), static_cast<int>(kv.second.size()),
                      value.data(), static_cast<int>(value.size()), 1);
    if (klen < 0 || vlen < 0) {
      return absl::InvalidArgumentError("query: bad percent-encoding");
    }
    key.resize(static_cast<size_t>(klen));
    value.resize(static_cast<size_t>(vlen));
    for (const auto& [k, v] : params) {
      if (k == key) {
        return absl::InvalidArgumentError(
            absl::StrCat("query: parameter '", key, "' given twice"));
      }
    }
    params.emplace_back(std::move(key), std::move(value));
  }
  return params;
}

// What an HTTP request presents, in the terms of a gRPC call's credentials:
// its Authorization header(s). No client certificates over plain HTTP.
CallerCredentials CallerFromRequest(const mg_request_info& info) {
  CallerCredentials caller;
  for (int i = 0; i < info.num_headers; ++i) {
    if (info.http_headers[i].name == nullptr ||
        !absl::EqualsIgnoreCase(info.http_headers[i].name, "authorization")) {
      continue;
    }
    if (caller.authorization.has_value()) {
      caller.ambiguous = true;
    } else {
      caller.authorization = info.http_headers[i].value != nullptr
                                 ? info.http_headers[i].value
                                 : "";
    }
  }
  return caller;
}

}  // namespace

absl::StatusOr<std::unique_ptr<StatusHttpServer>> StatusHttpServer::Start(
    const std::string& listen_address, Coordinator* coordinator,
    Metrics* metrics, const Authenticator* authenticator,
    bool client_certificates_required) {
  std::unique_ptr<StatusHttpServer> server(new StatusHttpServer(
      coordinator, metrics, authenticator, client_certificates_required));
  // civetweb takes "host:port" as listening_ports; "[v6]:port" too.
  const char* options[] = {"listening_ports",
                           listen_address.c_str(),
                           "num_threads",
                           "4",
                           "request_timeout_ms",
                           "5000",
                           "enable_keep_alive",
                           "no",
                           nullptr};
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof(callbacks));
  // Keeps civetweb's own error pages and log lines out of stderr: a bind
  // failure is reported below.
  callbacks.log_message = [](const mg_connection*, const char* message) {
    VLOG(1) << "http: " << message;
    return 1;
  };
  server->context_ = mg_start(&callbacks, nullptr, options);
  if (server->context_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve the status page on ", listen_address,
        " (address in use, not an address of this host, or not host:port?)"));
  }
  mg_server_port ports[4];
  const int n = mg_get_server_ports(server->context_, 4, ports);
  if (n <= 0) {
    server->Stop();
    return absl::UnavailableError(
        absl::StrCat("cannot serve the status page on ", listen_address));
  }
  server->port_ = ports[0].port;
  // One handler for every path: "/" alone would match only "/".
  mg_set_request_handler(server->context_, "**", &StatusHttpServer::Dispatch,
                         server.get());
  LOG(INFO) << "status page on http://" << listen_address << "/ (port "
            << server->port_ << "; JSON at /api/v1/status, metrics at "
            << "/metrics)";
  return server;
}

StatusHttpServer::~StatusHttpServer() { Stop(); }

void StatusHttpServer::Stop() {
  if (context_ == nullptr) return;
  mg_stop(context_);  // joins the worker threads
  context_ = nullptr;
  port_ = 0;
}

int StatusHttpServer::Dispatch(mg_connection* conn, void* self) {
  return static_cast<StatusHttpServer*>(self)->Handle(conn);
}

int StatusHttpServer::Handle(mg_connection* conn) {
  const mg_request_info* info = mg_get_request_info(conn);
  const std::string path = info->local_uri != nullptr ? info->local_uri : "";
  const std::string method =
      info->request_method != nullptr ? info->request_method : "";
  const bool known = path == "/" || path == "/index.html" ||
                     path == "/api/v1/status" || path == "/metrics";
  // The metric's method label names the route, never the request's own
  // path: a label per path would let any caller grow the registry.
  const std::string route = absl::StrCat("HTTP ", known ? path : "other");
  auto refuse = [&](absl::Status status, absl::string_view extra = "") {
    metrics_->RequestRejected(route, status.code());
    const std::string body = absl::StrCat(
        "{\"code\": \"", absl::StatusCodeToString(status.code()),
        "\", \"message\": \"", JsonEscape(status.message()), "\"}\n");
    return Respond(conn, HttpStatusOf(status.code()), "application/json", body,
                   extra);
  };
  if (!known) {
    return refuse(absl::NotFoundError(absl::StrCat(
        "no page ", path,
        " here: / (status page), /api/v1/status (JSON), /metrics")));
  }
  if (method != "GET" && method != "HEAD") {
    return refuse(absl::UnimplementedError(absl::StrCat(
                      "method ", method, " on ", path, ": only GET and HEAD")),
                  "Allow: GET, HEAD\r\n");
  }
  if (path == "/metrics") {
    return Respond(conn, 200, "text/plain; version=0.0.4; charset=utf-8",
                   metrics_->ScrapeText(coordinator_));
  }
  if (path == "/api/v1/status") {
    absl::StatusOr<std::vector<std::pair<std::string, std::string>>> params =
        ParseQuery(info->query_string);
    if (!params.ok()) return refuse(params.status());
    v1::GetJobStatusRequest request;
    for (const auto& [key, value] : *params) {
      if (key == "job") {
        request.set_job_id(value);
      } else if (key == "rounds") {
        uint32_t rounds = 0;
        if (!absl::SimpleAtoi(value, &rounds) || rounds < 1 || rounds > 100) {
          return refuse(absl::InvalidArgumentError(absl::StrCat(
              "query: rounds=", value, ": expected an integer in 1..100")));
        }
        request.set_max_rounds(rounds);
      } else {
        return refuse(absl::InvalidArgumentError(
            absl::StrCat("query: unknown parameter '", key,
                         "' (expected job=ID, rounds=N)")));
      }
    }
    // The same checks as the GetJobStatus RPC (service.cc), which over
    // mutual TLS also needs a client certificate: plain HTTP has none, so
    // without tokens such a coordinator shows no job here.
    const CallerCredentials caller = CallerFromRequest(*info);
    absl::Status status;
    if (client_certificates_required_ &&
        (authenticator_ == nullptr || !authenticator_->tokens_enabled())) {
      status = absl::PermissionDeniedError(
          "this coordinator admits only clients with a certificate (mutual "
          "TLS) and has no token file: the plain HTTP status page cannot "
          "tell who asks; use localsgdctl status with a client certificate, "
          "or configure --token_file");
    } else if (authenticator_ != nullptr) {
      status =
          request.job_id().empty()
              ? authenticator_->Authenticate(caller)
              : authenticator_->Authorize(caller, request.job_id()).status();
    }
    v1::GetJobStatusResponse response;
    if (status.ok()) {
      std::function<bool(const std::string&)> may_see;
      if (authenticator_ != nullptr) {
        may_see = [&](const std::string& job_id) {
          return authenticator_->MayAccess(caller, job_id);
        };
      }
      status = HandleGetJobStatus(*coordinator_, request, absl::Now(), may_see,
                                  &response);
    }
    if (!status.ok()) {
      return refuse(status,
                    status.code() == absl::StatusCode::kUnauthenticated
                        ? "WWW-Authenticate: Bearer realm=\"localsgd\"\r\n"
                        : "");
    }
    google::protobuf::util::JsonPrintOptions json_options;
    json_options.always_print_primitive_fields = true;
    json_options.preserve_proto_field_names = true;
    std::string json;
    if (!google::protobuf::util::MessageToJsonString(response, &json,
                                                     json_options)
             .ok()) {
      return refuse(absl::InternalError("status: cannot encode as JSON"));
    }
    json += "\n";
    return Respond(conn, 200, "application/json", json);
  }
  // The page: scripts and styles inline, nothing from elsewhere.
  return Respond(conn, 200, "text/html; charset=utf-8", DashboardPage(),
                 "Content-Security-Policy: default-src 'none'; "
                 "script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                 "connect-src 'self'; img-src 'self' data:\r\n");
}

}  // namespace localsgd
