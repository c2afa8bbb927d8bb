// apply_kernel_switches (backends/cuda/kernel_switches.h): every field of CudaOptions that picks a
// kernel-level path reaches its process-wide switch, the switches start at the verified defaults,
// and a bad gemm_kernel string throws before any switch changes. Touches no device (only the
// switches' values), but links the CUDA library, so it sits with the gpu tests.
#include <gtest/gtest.h>

#include "backends/cuda/kernel_switches.h"
#include "backends/cuda/kernels.h"
#include "backends/cuda/mixer_kernels.h"
#include "backends/cuda/quant_gemm.h"
#include "base/error.h"

namespace lily::test {
namespace {

/// The switches' values, in apply_kernel_switches' order.
struct Switches {
  bool pdl, stream_gemv, flash_prefill, device_sampler, gemv_row_tiles, gdn_chunk_parallel, gdn_local_mma,
      gdn_state_mma;
  cuda::GemmKernel gemm;

  static Switches now() {
    return {cuda::pdl_enabled(),           cuda::stream_gemv_enabled(),        cuda::flash_prefill_enabled(),
            cuda::device_sampler_enabled(), cuda::gemv_row_tiles_enabled(),    cuda::gdn_chunk_parallel_enabled(),
            cuda::gdn_local_mma_enabled(),  cuda::gdn_state_mma_enabled(),     cuda::gemm_kernel()};
  }
  bool operator==(const Switches&) const = default;
};

TEST(KernelSwitches, StartAtTheVerifiedDefaults) {
  // Before anything sets them (this test runs first in its process; gtest keeps file order).
  EXPECT_EQ(Switches::now(), (Switches{true, true, true, true, true, true, true, true, cuda::GemmKernel::kWgmmaMixed}));
  cuda::apply_kernel_switches(CudaOptions{});  // the defaults of CudaOptions are the same paths
  EXPECT_EQ(Switches::now(), (Switches{true, true, true, true, true, true, true, true, cuda::GemmKernel::kWgmmaMixed}));
}

TEST(KernelSwitches, EveryFieldReachesItsSwitch) {
  CudaOptions o;
  o.pdl = o.stream_gemv = o.flash_prefill = o.device_sampler = false;
  o.gemv_row_tiles = o.gdn_chunk_parallel = o.gdn_local_mma = o.gdn_state_mma = false;
  o.gemm_kernel = "0";
  cuda::apply_kernel_switches(o);
  EXPECT_EQ(Switches::now(), (Switches{false, false, false, false, false, false, false, false, cuda::GemmKernel::kOff}));
  o.gemm_kernel = "all";
  cuda::apply_kernel_switches(o);
  EXPECT_EQ(cuda::gemm_kernel(), cuda::GemmKernel::kAll);
  o.gemm_kernel = "wgmma";
  cuda::apply_kernel_switches(o);
  EXPECT_EQ(cuda::gemm_kernel(), cuda::GemmKernel::kWgmma);
  o.gemm_kernel = "wgmma-narrow";
  cuda::apply_kernel_switches(o);
  EXPECT_EQ(cuda::gemm_kernel(), cuda::GemmKernel::kWgmmaNarrow);
  o.gemm_kernel = "wgmma-mixed";
  cuda::apply_kernel_switches(o);
  EXPECT_EQ(cuda::gemm_kernel(), cuda::GemmKernel::kWgmmaMixed);
  // One at a time, so that no field sets another's switch.
  const auto one = [](bool CudaOptions::*field) {
    CudaOptions x;
    x.*field = false;
    return x;
  };
  cuda::apply_kernel_switches(one(&CudaOptions::pdl));
  EXPECT_FALSE(cuda::pdl_enabled());
  EXPECT_TRUE(cuda::stream_gemv_enabled());
  cuda::apply_kernel_switches(one(&CudaOptions::gdn_local_mma));
  EXPECT_TRUE(cuda::pdl_enabled());
  EXPECT_FALSE(cuda::gdn_local_mma_enabled());
  EXPECT_TRUE(cuda::gdn_state_mma_enabled());
  cuda::apply_kernel_switches(one(&CudaOptions::gdn_state_mma));
  EXPECT_TRUE(cuda::gdn_local_mma_enabled());
  EXPECT_FALSE(cuda::gdn_state_mma_enabled());
  EXPECT_TRUE(cuda::gdn_chunk_parallel_enabled());
  cuda::apply_kernel_switches(CudaOptions{});
}

TEST(KernelSwitches, RowsGemvFromReachesItsSetting) {
  cuda::apply_kernel_switches(CudaOptions{});
  EXPECT_EQ(cuda::rows_gemv_staging_min_rows(), cuda::kRowsGemvFromDefault);
  CudaOptions o;
  o.rows_gemv_from = 9;
  cuda::apply_kernel_switches(o);
  EXPECT_EQ(cuda::rows_gemv_staging_min_rows(), 9);
  cuda::apply_kernel_switches(CudaOptions{});
  EXPECT_EQ(cuda::rows_gemv_staging_min_rows(), cuda::kRowsGemvFromDefault);
  for (int bad : {0, CudaOptions::kRowsGemvNever + 1}) {
    o.pdl = false;
    o.rows_gemv_from = bad;
    EXPECT_THROW(cuda::apply_kernel_switches(o), Error) << bad;
    EXPECT_TRUE(cuda::pdl_enabled()) << "nothing set before the throw";
  }
}

/// A row-count threshold option (`field`, 1 … kRowsGemvNever) reaches the kernel layer's getter:
/// the default, a set value, and each out-of-range value refused before anything is set.
void check_rows_threshold(int CudaOptions::*field, int (*get)(), int default_value, int set_value) {
  cuda::apply_kernel_switches(CudaOptions{});
  EXPECT_EQ(get(), default_value);
  CudaOptions o;
  o.*field = set_value;
  cuda::apply_kernel_switches(o);
  EXPECT_EQ(get(), set_value);
  for (int bad : {0, CudaOptions::kRowsGemvNever + 1}) {
    o.pdl = false;
    o.*field = bad;
    EXPECT_THROW(cuda::apply_kernel_switches(o), Error) << bad;
    EXPECT_TRUE(cuda::pdl_enabled()) << "nothing set before the throw";
  }
  cuda::apply_kernel_switches(CudaOptions{});
  EXPECT_EQ(get(), default_value);
}

TEST(KernelSwitches, RowsGemvKsplitFromReachesItsSetting) {
  check_rows_threshold(&CudaOptions::rows_gemv_ksplit_from, cuda::rows_gemv_ksplit_from, cuda::kRowsGemvKsplitFromDefault,
                       33);
}

TEST(KernelSwitches, MoeTileClaimsFromReachesItsSetting) {
  check_rows_threshold(&CudaOptions::moe_tile_claims_from, cuda::moe_tile_claims_from_rows,
                       cuda::kMoeTileClaimsFromDefault, 33);
  for (int bad : {0, CudaOptions::kRowsGemvNever + 1}) EXPECT_THROW(cuda::set_moe_tile_claims_from_rows(bad), Error) << bad;
}

TEST(KernelSwitches, MoeTileClaimsFixedReachesItsSetting) {
  CudaOptions o;
  o.moe_tile_claims_fixed = 80;
  cuda::apply_kernel_switches(o);
  EXPECT_EQ(cuda::moe_tile_claims_fixed_percent(), 80);
  for (int bad : {-1, 101}) {
    o.pdl = false;
    o.moe_tile_claims_fixed = bad;
    EXPECT_THROW(cuda::apply_kernel_switches(o), Error) << bad;
    EXPECT_TRUE(cuda::pdl_enabled()) << "nothing set before the throw";
    EXPECT_THROW(cuda::set_moe_tile_claims_fixed_percent(bad), Error) << bad;
  }
  cuda::apply_kernel_switches(CudaOptions{});
  EXPECT_EQ(cuda::moe_tile_claims_fixed_percent(), cuda::kMoeTileClaimsFixedDefault);
}

TEST(KernelSwitches, RowsGemvSplitReachesItsSetting) {
  cuda::apply_kernel_switches(CudaOptions{});
  EXPECT_EQ(cuda::rows_gemv_split(), cuda::RowsGemvSplit::tiles);
  const std::pair<const char*, cuda::RowsGemvSplit> forms[] = {
      {"0", cuda::RowsGemvSplit::none}, {"all", cuda::RowsGemvSplit::all}, {"tiles", cuda::RowsGemvSplit::tiles}};
  for (const auto& [value, form] : forms) {
    CudaOptions o;
    o.rows_gemv_split = value;
    cuda::apply_kernel_switches(o);
    EXPECT_EQ(cuda::rows_gemv_split(), form) << value;
  }
  CudaOptions bad;
  bad.rows_gemv_split = "1";
  EXPECT_THROW(cuda::apply_kernel_switches(bad), Error);
  cuda::apply_kernel_switches(CudaOptions{});
  EXPECT_EQ(cuda::rows_gemv_split(), cuda::RowsGemvSplit::tiles);
}

TEST(KernelSwitches, GemvLateRequestsReachItsSetting) {
  cuda::apply_kernel_switches(CudaOptions{});
  EXPECT_EQ(cuda::stream_gemv_late_requests(), cuda::StreamLateRequests::none);
  CudaOptions o;
  for (auto [name, which] : {std::pair{"staged", cuda::StreamLateRequests::staged},
                             std::pair{"all", cuda::StreamLateRequests::all}, std::pair{"none", cuda::StreamLateRequests::none}}) {
    o.gemv_late_requests = name;
    cuda::apply_kernel_switches(o);
    EXPECT_EQ(cuda::stream_gemv_late_requests(), which) << name;
  }
  o.pdl = false;
  o.gemv_late_requests = "some";
  try {
    cuda::apply_kernel_switches(o);
    ADD_FAILURE() << "gemv_late_requests 'some' was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("LILY_CUDA_GEMV_LATE_REQUESTS"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(cuda::pdl_enabled()) << "nothing set before the throw";
  EXPECT_EQ(cuda::stream_gemv_late_requests(), cuda::StreamLateRequests::none);
}

TEST(KernelSwitches, MoeTileBalanceReachesItsSetting) {
  cuda::apply_kernel_switches(CudaOptions{});
  EXPECT_EQ(cuda::moe_tile_balance(), CudaOptions{}.moe_tile_balance);
  EXPECT_EQ(CudaOptions{}.moe_tile_balance, 8);
  CudaOptions o;
  o.moe_tile_balance = 0;
  cuda::apply_kernel_switches(o);
  EXPECT_EQ(cuda::moe_tile_balance(), 0);
  cuda::apply_kernel_switches(CudaOptions{});
  EXPECT_EQ(cuda::moe_tile_balance(), 8);
}

TEST(KernelSwitches, BadRegdqThrowsBeforeChangingAnything) {
  cuda::apply_kernel_switches(CudaOptions{});
  CudaOptions o;
  o.pdl = false;
  o.gemm_kernel = "dense";
  try {
    cuda::apply_kernel_switches(o);
    ADD_FAILURE() << "gemm_kernel 'dense' was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("LILY_CUDA_GEMM_KERNEL"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("dense"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(cuda::pdl_enabled());
  EXPECT_EQ(cuda::gemm_kernel(), cuda::GemmKernel::kWgmmaMixed);
}

}  // namespace
}  // namespace lily::test
