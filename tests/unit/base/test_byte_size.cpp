// Byte counts as flags take them (parse_byte_size) and as logs print them (format_bytes), and the
// host's memory from /proc/meminfo.
#include <gtest/gtest.h>

#include "base/byte_size.h"

namespace lily {
namespace {

TEST(ByteSize, PlainNumbersAndBinaryUnits) {
  EXPECT_EQ(parse_byte_size("0"), 0);
  EXPECT_EQ(parse_byte_size("1073741824"), int64_t{1} << 30);
  EXPECT_EQ(parse_byte_size("512B"), 512);
  EXPECT_EQ(parse_byte_size("4K"), 4096);
  EXPECT_EQ(parse_byte_size("512MiB"), int64_t{512} << 20);
  EXPECT_EQ(parse_byte_size("4G"), int64_t{4} << 30);
  EXPECT_EQ(parse_byte_size("4gb"), int64_t{4} << 30);
  EXPECT_EQ(parse_byte_size("1.5GiB"), int64_t{3} << 29);
  EXPECT_EQ(parse_byte_size("2TiB"), int64_t{2} << 40);
}

TEST(ByteSize, AnythingElseIsRefused) {
  for (const char* bad : {"", "-1", "G", "4 GiB", "4XB", "1.5.2G", ".5G", "5.G", "4Gi B", "4GiBs", "1e9", "0x10",
                          "9000000000T"})
    EXPECT_FALSE(parse_byte_size(bad).has_value()) << bad;
}

TEST(ByteSize, FormatsInPowersOf1024) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(1023), "1023 B");
  EXPECT_EQ(format_bytes(1536), "1.5 KiB");
  EXPECT_EQ(format_bytes(int64_t{63} << 20), "63.0 MiB");
  EXPECT_EQ(format_bytes(int64_t{4} << 30), "4.00 GiB");
}

TEST(ByteSize, HostMemoryIsReadFromProc) {
  const HostMemory m = read_host_memory();
  EXPECT_GT(m.total, 0);
  EXPECT_GT(m.available, 0);
  EXPECT_LE(m.available, m.total);
}

}  // namespace
}  // namespace lily
