// Job settings in one place: the table that declares each setting once
// (JobSettingSpecs: its name, the coordinator flag that sets its default,
// the flag's default and help, how its value reads and is written as text,
// how a member's wish is compared with the job's), which fields a request
// may leave unset, the limits a set field must respect, and how a
// request's fields combine with the coordinator's defaults.
//
// Adding a setting, one edit per layer:
//  1. the field: JobSettings (src/types.h) and localsgd.v1.JobSettings
//     (proto/localsgd/v1/coordinator.proto), same name;
//  2. its row in kSpecs (settings.cc) and, if a set value has a range, its
//     check in ValidateSetFields (or ValidateComplete for a rule across
//     fields);
//  3. its conversion in SettingsFromProto / SettingsToProto
//     (proto/convert.cc);
//  4. its bytes in the checkpoint (src/checkpoint.cc: a new format
//     version);
//  5. if it has a coordinator default, one LOCALSGD_SETTING_FLAG line in
//     server/main.cc (the flag's name, default and help come from the row;
//     LOCALSGD_<FLAG> sets it from the environment like every flag).
// localsgdctl status and the status page list every field of
// localsgd.v1.JobSettings without an edit. tests/core/settings_test.cc
// fails when a field has no row (a structured binding counts them), or a
// row is not carried by the protocol or the checkpoint;
// tests/deploy/consistency_test.py when a flag of the table is missing from
// --help, and tests/integration/settings_status_test.cc when localsgdctl
// status does not show a setting.
#ifndef LOCALSGD_SRC_SETTINGS_H_
#define LOCALSGD_SRC_SETTINGS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "src/types.h"

namespace localsgd {

// What a coordinator allows a job's settings to be.
struct SettingsLimits {
  // Largest chunk, in elements (a chunk must fit in a gRPC message).
  uint32_t max_chunk_elements = 4u << 20;
  // Most members a job may have: bounds rendezvous_members.
  uint32_t max_members = 1024;
};

// One job setting, declared once.
struct JobSettingSpec {
  // The JobSettings field and the localsgd.v1.JobSettings field.
  const char* name;
  // The coordinator flag that sets the default for new jobs (without the
  // dashes), or null where a job's first member alone sets it.
  const char* flag;
  // The flag's default, as the flag takes it; and its help.
  const char* flag_default;
  const char* help;
  // Whether `s` sets it (a request's "no preference" is the unset value).
  bool (*is_set)(const JobSettings& s);
  bool (*equal)(const JobSettings& a, const JobSettings& b);
  void (*copy)(const JobSettings& from, JobSettings& to);
  // "<the job's value described>; member asks for <the asked value>".
  std::string (*differs)(const JobSettings& job, const JobSettings& asked);
  // The value as text, as the flag takes it ("int8", "0.9", "16").
  std::string (*format)(const JobSettings& s);
  // Sets the field from `text`. INVALID_ARGUMENT saying what it takes.
  absl::Status (*parse)(absl::string_view text, JobSettings& s);
  // Sets a value other than the unset one, such that every row's probe
  // together make a job that runs: tests set every field this way and check
  // that each layer carries it.
  void (*probe)(JobSettings& s);
};

// Every job setting (in the order FirstDifference checks them).
absl::Span<const JobSettingSpec> JobSettingSpecs();
// The row named `name`, or null.
const JobSettingSpec* FindJobSetting(absl::string_view name);

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
