// Log levels: the names LILY_LOG accepts, and that a level hides the less severe lines.
#include <gtest/gtest.h>

#include <string>

#include "base/log.h"

namespace lily {
namespace {

TEST(Log, ParsesTheLevelNames) {
  EXPECT_EQ(parse_log_level("debug"), LogLevel::kDebug);
  EXPECT_EQ(parse_log_level("info"), LogLevel::kInfo);
  EXPECT_EQ(parse_log_level("warning"), LogLevel::kWarn);
  EXPECT_EQ(parse_log_level("warn"), LogLevel::kWarn);
  EXPECT_EQ(parse_log_level("error"), LogLevel::kError);
  EXPECT_EQ(parse_log_level("quiet"), LogLevel::kQuiet);
  for (const char* bad : {"", "DEBUG", "verbose", "debug ", "2"})
    EXPECT_EQ(parse_log_level(bad), std::nullopt) << bad;
}

TEST(Log, TheLevelHidesLessSevereLines) {
  const LogLevel before = log_level();
  set_log_level(LogLevel::kWarn);
  testing::internal::CaptureStderr();
  log_info("hidden line");
  log_warn("shown line");
  const std::string err = testing::internal::GetCapturedStderr();
  set_log_level(before);
  EXPECT_EQ(err, "lily: warning: shown line\n");
}

}  // namespace
}  // namespace lily
