// glog side of client/log_bridge.h. Includes no LibTorch header.
#include "client/log_bridge.h"

#include <glog/logging.h>
#include <glog/vlog_is_on.h>

#include <map>
#include <mutex>
#include <string>

namespace localsgd {
namespace log_internal {

void Emit(Severity severity, const char* file, int line,
          const std::string& message) {
  if (severity == kFatal) {
    google::LogMessageFatal(file, line).stream() << message;
  }
  google::LogMessage(file, line, static_cast<google::LogSeverity>(severity))
          .stream()
      << message;
}

bool VlogIsOn(const char* file, int level) {
  // glog's VLOG_IS_ON keeps one SiteFlag per call site; here one per source
  // file (what --vmodule matches), kept for the process's lifetime since
  // glog remembers its address for SetVLOGLevel.
  static std::mutex* mu = new std::mutex;
  static auto* sites = new std::map<std::string, google::SiteFlag>;
  std::lock_guard<std::mutex> lock(*mu);
  auto it = sites->try_emplace(file).first;
  google::SiteFlag& site = it->second;
  if (site.level != nullptr) return *site.level >= level;
  return google::InitVLOG3__(&site, &FLAGS_v, it->first.c_str(), level);
}

}  // namespace log_internal
}  // namespace localsgd
