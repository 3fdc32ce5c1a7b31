// The job settings table (src/settings.h): every row reads what it writes,
// its probe value is a real, non-default value, and the rules that combine
// settings read the table.
#include "src/settings.h"

#include <set>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace localsgd {
namespace {

using ::testing::HasSubstr;

JobSettings AllProbed() {
  JobSettings s;
  for (const JobSettingSpec& spec : JobSettingSpecs()) spec.probe(s);
  return s;
}

TEST(SettingsTableTest, EveryRow_HasANameHelpAndAUniqueFlag) {
  std::set<std::string> names, flags;
  for (const JobSettingSpec& spec : JobSettingSpecs()) {
    EXPECT_TRUE(names.insert(spec.name).second) << spec.name;
    EXPECT_GT(std::string(spec.help).size(), 20u) << spec.name;
    EXPECT_EQ(FindJobSetting(spec.name), &spec);
    if (spec.flag == nullptr) continue;
    EXPECT_TRUE(flags.insert(spec.flag).second) << spec.flag;
    EXPECT_FALSE(std::string(spec.flag_default).empty()) << spec.name;
  }
  EXPECT_EQ(FindJobSetting("no_such_setting"), nullptr);
}

TEST(SettingsTableTest, EveryRow_ParsesWhatItFormats) {
  const JobSettings probed = AllProbed();
  for (const JobSettingSpec& spec : JobSettingSpecs()) {
    JobSettings back;
    ASSERT_TRUE(spec.parse(spec.format(probed), back).ok()) << spec.name;
    EXPECT_TRUE(spec.equal(back, probed)) << spec.name;
  }
}

// (A probe may equal the flag's default where the other probes need it: a
// job of pseudo-gradients, for int8 and an outer rule. The flags are read
// by one loop over the rows, and a row whose flag is not declared stops
// the coordinator at start: settings_layers_tests.)
TEST(SettingsTableTest, EveryProbe_IsSet_EveryFlagDefaultParses) {
  for (const JobSettingSpec& spec : JobSettingSpecs()) {
    JobSettings probed;
    spec.probe(probed);
    EXPECT_TRUE(spec.is_set(probed)) << spec.name;
    EXPECT_FALSE(spec.is_set(JobSettings())) << spec.name;
    if (spec.flag == nullptr) continue;
    JobSettings defaulted;
    ASSERT_TRUE(spec.parse(spec.flag_default, defaulted).ok()) << spec.name;
    EXPECT_TRUE(spec.is_set(defaulted)) << spec.name;
  }
}

TEST(SettingsTableTest, AllProbes_MakeAJobThatRuns) {
  EXPECT_TRUE(ValidateComplete(AllProbed(), SettingsLimits(), "").ok());
}

TEST(SettingsTableTest, WithDefaultsAndFirstDifference_ReadEveryRow) {
  const JobSettings probed = AllProbed();
  // No preference takes every default; every wish overrides it.
  EXPECT_EQ(FirstDifference(WithDefaults(JobSettings(), probed), probed), "");
  for (const JobSettingSpec& spec : JobSettingSpecs()) {
    JobSettings asked;
    spec.probe(asked);
    JobSettings job;
    const JobSettings merged = WithDefaults(asked, job);
    EXPECT_TRUE(spec.equal(merged, asked)) << spec.name;
    // A job without the wish differs in that row, and says so.
    EXPECT_FALSE(FirstDifference(job, asked).empty()) << spec.name;
  }
}

TEST(SettingsTableTest, Parse_BadValues_SayWhatTheyTake) {
  JobSettings s;
  absl::Status st = FindJobSetting("wire_dtype")->parse("int16", s);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()),
              HasSubstr("must be one of float32, bfloat16, int8, int4, "
                        "sparse2, sparse4; got 'int16'"));
  st = FindJobSetting("chunk_elements")->parse("-5", s);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(st.message()), HasSubstr("got '-5'"));
  st = FindJobSetting("outer_lr")->parse("fast", s);
  EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.chunk_elements, 0u);
  EXPECT_EQ(s.outer_lr, 0.0f);
}

}  // namespace
}  // namespace localsgd
