// glog for translation units that include LibTorch headers.
//
// A LibTorch built without glog (the pip wheels, LibTorch 2.x) defines its
// own LOG, VLOG, CHECK, DCHECK, ... macros in c10/util/Logging.h, which every
// c10d header includes; <glog/logging.h> in the same translation unit
// redefines them (or has them redefined), depending on the include order.
// So client/node_group.cc and client/local_sgd.cc do not include glog: they
// log through these macros, which hand the message to glog in
// client/log_bridge.cc (no LibTorch there). The output is what glog's own
// macros give: same sink and flags, the caller's file:line, and --vmodule
// matches the caller's file name.
//
//   LOCALSGD_LOG(INFO) << "...";      // INFO, WARNING, ERROR, FATAL
//   LOCALSGD_VLOG(1) << "...";
//   LOCALSGD_CHECK(condition) << "...";
#ifndef LOCALSGD_CLIENT_LOG_BRIDGE_H_
#define LOCALSGD_CLIENT_LOG_BRIDGE_H_

#include <ostream>
#include <sstream>
#include <string>

namespace localsgd {
namespace log_internal {

// glog's severities.
enum Severity : int { kInfo = 0, kWarning = 1, kError = 2, kFatal = 3 };

// Logs `message` through glog as if LOG(severity) at file:line had; kFatal
// does not return.
void Emit(Severity severity, const char* file, int line,
          const std::string& message);
// glog's VLOG_IS_ON(level) for a call site in `file` (--v, --vmodule).
bool VlogIsOn(const char* file, int level);

// One message: collects the stream, emits it when destroyed.
class Line {
 public:
  Line(Severity severity, const char* file, int line)
      : severity_(severity), file_(file), line_(line) {}
  Line(const Line&) = delete;
  Line& operator=(const Line&) = delete;
  ~Line() { Emit(severity_, file_, line_, stream_.str()); }
  std::ostream& stream() { return stream_; }

 private:
  Severity severity_;
  const char* file_;
  int line_;
  std::ostringstream stream_;
};

// Turns `stream << ...` into void for the conditional macros below.
struct Voidify {
  void operator&(std::ostream&) {}
};

}  // namespace log_internal
}  // namespace localsgd

#define LOCALSGD_LOG_SEVERITY_INFO ::localsgd::log_internal::kInfo
#define LOCALSGD_LOG_SEVERITY_WARNING ::localsgd::log_internal::kWarning
#define LOCALSGD_LOG_SEVERITY_ERROR ::localsgd::log_internal::kError
#define LOCALSGD_LOG_SEVERITY_FATAL ::localsgd::log_internal::kFatal

#define LOCALSGD_LOG(severity)                                               \
  ::localsgd::log_internal::Line(LOCALSGD_LOG_SEVERITY_##severity, __FILE__, \
                                 __LINE__)                                   \
      .stream()

#define LOCALSGD_VLOG(level)                                                \
  !::localsgd::log_internal::VlogIsOn(__FILE__, (level))                    \
      ? (void)0                                                             \
      : ::localsgd::log_internal::Voidify() &                               \
            ::localsgd::log_internal::Line(::localsgd::log_internal::kInfo, \
                                           __FILE__, __LINE__)              \
                .stream()

#define LOCALSGD_CHECK(condition)                                             \
  (condition) ? (void)0                                                       \
              : ::localsgd::log_internal::Voidify() &                         \
                    ::localsgd::log_internal::Line(                           \
                        ::localsgd::log_internal::kFatal, __FILE__, __LINE__) \
                            .stream()                                         \
                        << "Check failed: " #condition " "

#endif  // LOCALSGD_CLIENT_LOG_BRIDGE_H_
