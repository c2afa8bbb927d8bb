// bf16 conversion: exact round trips and round-to-nearest-even on ties.
#include <gtest/gtest.h>

#include <cmath>

#include "base/bf16.h"

TEST(Bf16, RoundTripsRepresentableValues) {
  for (float f : {0.0f, 1.0f, -2.5f, 0.15625f, 65536.0f}) EXPECT_EQ(lily::round_bf16(f), f);
}

TEST(Bf16, RoundsToNearestEven) {
  // 1 + 2^-8 lies exactly between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(lily::round_bf16(1.0f + std::ldexp(1.0f, -8)), 1.0f);
  // 1 + 3·2^-8 lies between 1+2^-7 (odd) and 1+2^-6 (even): goes up to 1 + 2^-6.
  EXPECT_EQ(lily::round_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 1.0f + std::ldexp(1.0f, -6));
}

TEST(Bf16, NanStaysNan) { EXPECT_TRUE(std::isnan(lily::round_bf16(std::nanf("")))); }
