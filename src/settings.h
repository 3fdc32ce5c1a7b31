// Job settings rules, in one place: which fields a request may leave unset,
// the limits a set field must respect, how a request's fields combine with
// the coordinator's defaults, and how a member's wishes are compared with
// the settings of the job it joins.
//
// Adding a setting: a field in JobSettings (src/types.h), a row in
// kSettingFields (settings.cc), its range in ValidateSetFields, and its
// conversion in the protocol layer (proto/convert.cc).
#ifndef LOCALSGD_SRC_SETTINGS_H_
#define LOCALSGD_SRC_SETTINGS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "src/types.h"

namespace localsgd {

// What a coordinator allows a job's settings to be.
struct SettingsLimits {
  // Largest chunk, in elements (a chunk must fit in a gRPC message).
  uint32_t max_chunk_elements = 4u << 20;
  // Most members a job may have: bounds rendezvous_members.
  uint32_t max_members = 1024;
};

// Checks the fields `settings` sets (zero / unspecified fields are "no
// preference" and pass). INVALID_ARGUMENT naming the field and the allowed
// values; `what` prefixes the message ("" for a request's settings).
absl::Status ValidateSetFields(const JobSettings& settings,
                               const SettingsLimits& limits,
                               absl::string_view what = "");

// Checks settings a job can run with: every field that has no meaning when
// unset (chunk_elements, wire_dtype, mode, nonfinite_policy) is set, and
// every set field is valid. INVALID_ARGUMENT naming the first bad field.
absl::Status ValidateComplete(const JobSettings& settings,
                              const SettingsLimits& limits,
                              absl::string_view what);

// `asked`'s set fields over `defaults`.
JobSettings WithDefaults(const JobSettings& asked, const JobSettings& defaults);

// The first field that `asked` sets to something other than `job` has, as
// "<job's> ...; member asks for <asked's>" (e.g. "syncs every 16 steps;
// member asks for 8"); empty if every set field agrees.
std::string FirstDifference(const JobSettings& job, const JobSettings& asked);

}  // namespace localsgd

#endif  // LOCALSGD_SRC_SETTINGS_H_
