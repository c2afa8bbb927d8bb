// parse_backend_kind, resolve_cuda_options and make_backend (engine/backend.h, backends/backend_factory.cpp).
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "base/error.h"
#include "engine/backend.h"
#include "engine/option_error.h"
#include "model/loader.h"
#include "support/test_support.h"

namespace lily {
namespace {

TEST(BackendFactory, ParsesTheThreeKinds) {
  EXPECT_EQ(parse_backend_kind("cpu"), BackendKind::kCpu);
  EXPECT_EQ(parse_backend_kind("cuda"), BackendKind::kCuda);
  EXPECT_EQ(parse_backend_kind("auto"), BackendKind::kAuto);
  try {
    parse_backend_kind("gpu");
    FAIL() << "expected lily::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'gpu'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(parse_backend_kind(""), Error);
}

// The reported limit is the one a backend's new_state enforces.
TEST(BackendFactory, ReportsTheLongestSequenceItsBackendCreates) {
  const int64_t cpu_limit = backend_max_sequence(BackendKind::kCpu);
  EXPECT_EQ(cpu_limit, kMaxContext);
  EXPECT_LE(backend_max_sequence(BackendKind::kAuto), cpu_limit);
  EXPECT_GE(backend_max_sequence(BackendKind::kCuda), 2);
  auto cpu = make_backend(BackendKind::kCpu, load_model(test::demo_model_dir()), 1, CudaOptions{});
  EXPECT_THROW(cpu->new_state(cpu_limit + 1), Error);
  EXPECT_NO_THROW(cpu->new_state(2));
}

TEST(BackendFactory, RejectsMissingWeights) {
  EXPECT_THROW(make_backend(BackendKind::kCpu, nullptr, 0, CudaOptions{}), Error);
}

TEST(BackendFactory, CpuAndAutoWithoutCuda) {
  auto weights = load_model(test::demo_model_dir());
  auto cpu = make_backend(BackendKind::kCpu, weights, 1, CudaOptions{});
  EXPECT_EQ(cpu->name(), "cpu");
  EXPECT_EQ(cpu->config().vocab, weights->config.vocab);
#ifdef LILY_HAVE_CUDA
  // A CUDA build: on a machine without a usable GPU (CI), --backend cuda is a clear error and
  // auto falls back to the CPU; on the H200 both give the CUDA backend.
  std::unique_ptr<Backend> cuda;
  try {
    cuda = make_backend(BackendKind::kCuda, weights, 0, CudaOptions::from_env());
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_TRUE(what.find("no usable CUDA device") != std::string::npos ||
                what.find("compute capability") != std::string::npos)
        << what;
    EXPECT_EQ(make_backend(BackendKind::kAuto, weights, 0, CudaOptions::from_env())->name(), "cpu");
    return;
  }
  EXPECT_EQ(cuda->name(), "cuda");
  cuda.reset();
  EXPECT_EQ(make_backend(BackendKind::kAuto, weights, 0, CudaOptions::from_env())->name(), "cuda");
#else
  try {
    make_backend(BackendKind::kCuda, weights, 0, CudaOptions::from_env());
    FAIL() << "expected lily::Error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "the CUDA backend was asked for, but this build has no CUDA support (nvcc was not found at build time)");
  }
  EXPECT_EQ(make_backend(BackendKind::kAuto, weights, 0, CudaOptions::from_env())->name(), "cpu");
#endif
}

/// Sets environment variables for one scope and restores them.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (old_) setenv(name_, old_->c_str(), 1);
    else unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

TEST(CudaOptions, DefaultsAreTheVerifiedPaths) {
  for (const char* v : {"LILY_CUDA_FUSE", "LILY_CUDA_PDL", "LILY_CUDA_STREAM_GEMV", "LILY_CUDA_FLASH_PREFILL",
                        "LILY_CUDA_DEVICE_SAMPLER", "LILY_CUDA_GEMV_TILE_COUNTER", "LILY_CUDA_GEMV_BLOCKS_PER_SM", "LILY_CUDA_GEMV_SMEM_KIB", "LILY_CUDA_GEMV_LATE_REQUESTS", "LILY_CUDA_GEMV_ROW_TILES", "LILY_CUDA_GDN_CHUNK_PARALLEL", "LILY_CUDA_GDN_LOCAL_MMA", "LILY_CUDA_GDN_STATE_MMA", "LILY_CUDA_PREFILL", "LILY_CUDA_GEMM", "LILY_CUDA_GEMM_KERNEL", "LILY_CUDA_FUSED_MOE", "LILY_CUDA_MOE_OUT_PROJ", "LILY_CUDA_MOE_NEXT_NORM", "LILY_CUDA_MOE_TILE_BALANCE", "LILY_CUDA_BATCHED_DECODE", "LILY_CUDA_PREFILL_CHUNK", "LILY_CUDA_MAX_BATCH", "LILY_CUDA_DECODE_ROWS", "LILY_CUDA_ROWS_GEMV_FROM", "LILY_CUDA_ROWS_GEMV_SPLIT", "LILY_CUDA_ROWS_GEMV_KSPLIT_FROM", "LILY_CUDA_PREFILL_ROWS", "LILY_CUDA_PERSISTENT_DECODE"})
    unsetenv(v);
  const CudaOptions o = CudaOptions::from_env();
  EXPECT_TRUE(o.fuse_decode);
  EXPECT_TRUE(o.pdl);
  EXPECT_TRUE(o.stream_gemv);
  EXPECT_TRUE(o.gemv_tile_counter);
  EXPECT_EQ(o.gemv_blocks_per_sm, 4);
  EXPECT_EQ(o.gemv_smem_kib, 112);
  EXPECT_EQ(o.gemv_late_requests, "none");
  EXPECT_TRUE(o.flash_prefill);
  EXPECT_TRUE(o.device_sampler);
  EXPECT_TRUE(o.gemv_row_tiles);
  EXPECT_TRUE(o.gdn_chunk_parallel);
  EXPECT_TRUE(o.gdn_local_mma);
  EXPECT_TRUE(o.gdn_state_mma);
  EXPECT_TRUE(o.batched_prefill);
  EXPECT_TRUE(o.tensor_core_gemm);
  EXPECT_EQ(o.gemm_kernel, "wgmma-mixed");
  EXPECT_TRUE(o.fused_moe);
  EXPECT_FALSE(o.moe_out_proj);
  EXPECT_FALSE(o.moe_next_norm);
  EXPECT_EQ(o.moe_tile_balance, 8);
  EXPECT_EQ(o.moe_tile_claims_from, 17);
  EXPECT_EQ(o.moe_tile_claims_fixed, 75);
  EXPECT_FALSE(o.rows_gemv_norm);
  EXPECT_TRUE(o.batched_decode);
  EXPECT_EQ(o.prefill_chunk, 4096);
  EXPECT_EQ(o.max_batch, 64);
  EXPECT_EQ(o.decode_rows, 64);
  EXPECT_EQ(o.rows_gemv_from, 2);
  EXPECT_EQ(o.rows_gemv_split, "tiles");
  EXPECT_EQ(o.rows_gemv_ksplit_from, 9);
  EXPECT_TRUE(o.prefill_rows);
  EXPECT_EQ(o.describe(), "fuse=1 pdl=1 stream-gemv=1 gemv-tile-counter=1 gemv-blocks-per-sm=4 gemv-smem-kib=112 gemv-late-requests=none flash-prefill=1 device-sampler=1 gemv-row-tiles=1 gdn-chunk-parallel=1 gdn-local-mma=1 gdn-state-mma=1 prefill=batched gemm=tensor-core gemm-kernel=wgmma-mixed fused-moe=1 moe-out-proj=0 moe-next-norm=0 moe-tile-balance=8 moe-tile-claims-from=17 moe-tile-claims-fixed=75 batched-decode=1 chunk=4096 max-batch=64 decode-rows=64 rows-gemv-from=2 rows-gemv-split=tiles rows-gemv-ksplit-from=9 rows-gemv-norm=0 prefill-rows=1 persistent-decode=0");
}

TEST(CudaOptions, ReadsEveryVariable) {
  ScopedEnv a("LILY_CUDA_FUSE", "0"), b("LILY_CUDA_PDL", "0"), c("LILY_CUDA_PREFILL", "per-token"),
      d("LILY_CUDA_GEMM", "gemv"), e("LILY_CUDA_PREFILL_CHUNK", "256"), f("LILY_CUDA_STREAM_GEMV", "0"),
      g("LILY_CUDA_FLASH_PREFILL", "0"), h("LILY_CUDA_DEVICE_SAMPLER", "0"),
      i("LILY_CUDA_GEMV_ROW_TILES", "0"), j("LILY_CUDA_GDN_CHUNK_PARALLEL", "0"), k("LILY_CUDA_MAX_BATCH", "16"),
      l("LILY_CUDA_FUSED_MOE", "0"), m("LILY_CUDA_BATCHED_DECODE", "0"), n("LILY_CUDA_GDN_LOCAL_MMA", "0"),
      p("LILY_CUDA_GDN_STATE_MMA", "0"), q("LILY_CUDA_GEMM_KERNEL", "0"), r("LILY_CUDA_ROWS_GEMV_FROM", "9"), t("LILY_CUDA_PREFILL_ROWS", "1"),
      u("LILY_CUDA_DECODE_ROWS", "64"), v("LILY_CUDA_PERSISTENT_DECODE", "debug"), w("LILY_CUDA_MOE_OUT_PROJ", "1"),
      x("LILY_CUDA_GEMV_TILE_COUNTER", "0"), y("LILY_CUDA_GEMV_BLOCKS_PER_SM", "2"), z("LILY_CUDA_GEMV_SMEM_KIB", "224"),
      aa("LILY_CUDA_GEMV_LATE_REQUESTS", "staged"), ab("LILY_CUDA_MOE_NEXT_NORM", "1"),
      ac("LILY_CUDA_MOE_TILE_BALANCE", "12"), ad("LILY_CUDA_ROWS_GEMV_SPLIT", "0"),
      ae("LILY_CUDA_ROWS_GEMV_KSPLIT_FROM", "33"), af("LILY_CUDA_MOE_TILE_CLAIMS_FROM", "40"),
      ag("LILY_CUDA_ROWS_GEMV_NORM", "1"), ah("LILY_CUDA_MOE_TILE_CLAIMS_FIXED", "75");
  const CudaOptions o = CudaOptions::from_env();
  EXPECT_FALSE(o.gdn_local_mma);
  EXPECT_FALSE(o.gdn_state_mma);
  EXPECT_EQ(o.gemm_kernel, "0");
  EXPECT_EQ(o.describe(), "fuse=0 pdl=0 stream-gemv=0 gemv-tile-counter=0 gemv-blocks-per-sm=2 gemv-smem-kib=224 gemv-late-requests=staged flash-prefill=0 device-sampler=0 gemv-row-tiles=0 gdn-chunk-parallel=0 gdn-local-mma=0 gdn-state-mma=0 prefill=per-token gemm=gemv gemm-kernel=0 fused-moe=0 moe-out-proj=1 moe-next-norm=1 moe-tile-balance=12 moe-tile-claims-from=40 moe-tile-claims-fixed=75 batched-decode=0 chunk=256 max-batch=16 decode-rows=64 rows-gemv-from=9 rows-gemv-split=0 rows-gemv-ksplit-from=33 rows-gemv-norm=1 prefill-rows=1 persistent-decode=debug");
}

/// The kernel-layer switches (the GDN passes' tensor cores, the GEMM kernel): each one alone,
/// against the defaults (the other fields keep theirs).
TEST(CudaOptions, ReadsTheKernelSwitches) {
  for (const char* v : {"LILY_CUDA_GDN_LOCAL_MMA", "LILY_CUDA_GDN_STATE_MMA", "LILY_CUDA_GEMM_KERNEL"})
    unsetenv(v);
  {
    ScopedEnv env("LILY_CUDA_GDN_LOCAL_MMA", "0");
    const CudaOptions o = CudaOptions::from_env();
    EXPECT_FALSE(o.gdn_local_mma);
    EXPECT_TRUE(o.gdn_state_mma);
    EXPECT_NE(o.describe().find(" gdn-local-mma=0 gdn-state-mma=1 "), std::string::npos) << o.describe();
  }
  {
    ScopedEnv env("LILY_CUDA_GDN_STATE_MMA", "0");
    const CudaOptions o = CudaOptions::from_env();
    EXPECT_TRUE(o.gdn_local_mma);
    EXPECT_FALSE(o.gdn_state_mma);
    EXPECT_NE(o.describe().find(" gdn-local-mma=1 gdn-state-mma=0 "), std::string::npos) << o.describe();
  }
  for (const char* on : {"1", ""}) {  // "1" and empty (as unset): the default
    ScopedEnv a("LILY_CUDA_GDN_LOCAL_MMA", on), b("LILY_CUDA_GDN_STATE_MMA", on);
    const CudaOptions o = CudaOptions::from_env();
    EXPECT_TRUE(o.gdn_local_mma) << "'" << on << "'";
    EXPECT_TRUE(o.gdn_state_mma) << "'" << on << "'";
  }
  for (const char* mode : {"grouped", "all", "0", "wgmma", "wgmma-narrow", "wgmma-mixed"}) {
    ScopedEnv env("LILY_CUDA_GEMM_KERNEL", mode);
    const CudaOptions o = CudaOptions::from_env();
    EXPECT_EQ(o.gemm_kernel, mode);
    EXPECT_NE(o.describe().find(std::string(" gemm-kernel=") + mode + " "), std::string::npos) << o.describe();
  }
  {
    ScopedEnv env("LILY_CUDA_GEMM_KERNEL", "");
    EXPECT_EQ(CudaOptions::from_env().gemm_kernel, "wgmma-mixed");
  }
}

TEST(CudaOptions, BadValuesNameTheVariable) {
  const std::pair<const char*, const char*> bad[] = {{"LILY_CUDA_FUSE", "yes"},          {"LILY_CUDA_PDL", "2"}, {"LILY_CUDA_STREAM_GEMV", "on"}, {"LILY_CUDA_FLASH_PREFILL", "yes"}, {"LILY_CUDA_DEVICE_SAMPLER", "on"}, {"LILY_CUDA_GEMV_ROW_TILES", "2"}, {"LILY_CUDA_GDN_CHUNK_PARALLEL", "yes"}, {"LILY_CUDA_FUSED_MOE", "2"}, {"LILY_CUDA_MOE_OUT_PROJ", "yes"}, {"LILY_CUDA_BATCHED_DECODE", "on"},
                                                     {"LILY_CUDA_GDN_LOCAL_MMA", "yes"}, {"LILY_CUDA_GDN_STATE_MMA", "2"},
                                                     {"LILY_CUDA_GEMM_KERNEL", "dense"},  {"LILY_CUDA_GEMM_KERNEL", "1"},
                                                     {"LILY_CUDA_PREFILL", "chunked"},   {"LILY_CUDA_GEMM", "cublas"},
                                                     {"LILY_CUDA_PREFILL_CHUNK", "0"},   {"LILY_CUDA_PREFILL_CHUNK", "8193"},
                                                     {"LILY_CUDA_PREFILL_CHUNK", "12x"}, {"LILY_CUDA_PREFILL_CHUNK", "99999999999999999999"},
                                                     {"LILY_CUDA_MAX_BATCH", "0"},       {"LILY_CUDA_MAX_BATCH", "65"},
                                                     {"LILY_CUDA_MAX_BATCH", "four"},    {"LILY_CUDA_ROWS_GEMV_FROM", "0"},
                                                     {"LILY_CUDA_ROWS_GEMV_FROM", "66"},
                                                     {"LILY_CUDA_ROWS_GEMV_KSPLIT_FROM", "0"}, {"LILY_CUDA_ROWS_GEMV_KSPLIT_FROM", "66"},
                                                     {"LILY_CUDA_DECODE_ROWS", "0"},     {"LILY_CUDA_DECODE_ROWS", "65"},
                                                     {"LILY_CUDA_PREFILL_ROWS", "yes"}, {"LILY_CUDA_ROWS_GEMV_SPLIT", "1"},
                                                     {"LILY_CUDA_MOE_TILE_BALANCE", "-1"}, {"LILY_CUDA_MOE_TILE_BALANCE", "1025"}};
  for (const auto& [name, value] : bad) {
    ScopedEnv env(name, value);
    try {
      CudaOptions::from_env();
      ADD_FAILURE() << name << "=" << value << " was accepted";
    } catch (const OptionError& e) {  // the variable is the option's name, with no flag in sight
      EXPECT_EQ(e.field(), name);
      EXPECT_EQ(std::string(e.what()).rfind(std::string(name) + " must be ", 0), 0u) << e.what();
      EXPECT_NE(e.detail().find(std::string("got '") + value + "'"), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find("--"), std::string::npos) << e.what();
    }
  }
}

/// --backend auto must not fall back to the CPU over a bad CUDA setting (the user asked for it):
/// resolve_cuda_options refuses it before any backend is made.
TEST(CudaOptions, AutoRefusesABadValueInsteadOfFallingBack) {
  auto weights = load_model(test::demo_model_dir());
  ScopedEnv env("LILY_CUDA_GEMM", "tensorcore");
  EXPECT_THROW(resolve_cuda_options(BackendKind::kAuto, {}), Error);
  EXPECT_THROW(resolve_cuda_options(BackendKind::kCuda, {}), Error);
  // The CPU backend has no CUDA options: the variables are not read.
  EXPECT_EQ(make_backend(BackendKind::kCpu, weights, 1, resolve_cuda_options(BackendKind::kCpu, {}))->name(), "cpu");
}

/// `--cuda NAME=VALUE` (CudaOptions::set): every name describe() prints is a name set() takes,
/// with the value describe() prints, so a report's cuda_options can be given back field by field.
TEST(CudaOptions, SetTakesEveryDescribedField) {
  CudaOptions changed;
  for (const char* a : {"fuse=0", "pdl=0", "stream-gemv=0", "gemv-tile-counter=0", "gemv-blocks-per-sm=3", "gemv-smem-kib=160", "gemv-late-requests=all", "flash-prefill=0", "device-sampler=0", "gemv-row-tiles=0",
                        "gdn-chunk-parallel=0", "gdn-local-mma=0", "gdn-state-mma=0", "prefill=per-token", "gemm=gemv",
                        "gemm-kernel=grouped", "fused-moe=0", "moe-out-proj=1", "moe-next-norm=1", "moe-tile-balance=7", "moe-tile-claims-from=3", "moe-tile-claims-fixed=60", "batched-decode=0", "chunk=512", "max-batch=7",
                        "decode-rows=48", "rows-gemv-from=9", "rows-gemv-split=all", "rows-gemv-ksplit-from=17", "rows-gemv-norm=1", "prefill-rows=1", "persistent-decode=1"})
    changed.set(a);
  EXPECT_EQ(changed.describe(), "fuse=0 pdl=0 stream-gemv=0 gemv-tile-counter=0 gemv-blocks-per-sm=3 gemv-smem-kib=160 "
                                "gemv-late-requests=all flash-prefill=0 device-sampler=0 gemv-row-tiles=0 "
                                "gdn-chunk-parallel=0 gdn-local-mma=0 gdn-state-mma=0 prefill=per-token gemm=gemv "
                                "gemm-kernel=grouped fused-moe=0 moe-out-proj=1 moe-next-norm=1 moe-tile-balance=7 moe-tile-claims-from=3 moe-tile-claims-fixed=60 batched-decode=0 chunk=512 max-batch=7 "
                                "decode-rows=48 rows-gemv-from=9 rows-gemv-split=all rows-gemv-ksplit-from=17 rows-gemv-norm=1 prefill-rows=1 persistent-decode=1");
  // describe()'s own words, given back one by one, rebuild the same options.
  CudaOptions rebuilt;
  std::istringstream words(changed.describe());
  for (std::string w; words >> w;) rebuilt.set(w);
  EXPECT_EQ(rebuilt.describe(), changed.describe());
}

/// set() speaks of the setting only, never of a front end's flag: a value the field does not take
/// is an OptionError naming the field as set() spells it; an unknown name or a missing '=' an
/// Error that begins with the setting in quotes.
TEST(CudaOptions, SetRefusesWhatItDoesNotKnowAndChangesNothing) {
  struct Bad {
    const char* assignment;
    const char* field;    ///< the OptionError's field; nullptr: a plain Error, not an OptionError
    const char* message;  ///< what() begins with it
  };
  const Bad bad[] = {{"bogus=1", nullptr, "'bogus=1': unknown option 'bogus'; the options are fuse, pdl, stream-gemv"},
                     {"pdl", nullptr, "'pdl': expected NAME=VALUE, e.g. pdl=<value>"},
                     {"pdl=2", "pdl", "pdl must be '1' or '0', got '2'"},
                     {"max-batch=65", "max-batch", "max-batch must be an integer in 1…64, got '65'"},
                     {"decode-rows=0", "decode-rows", "decode-rows must be an integer in 1…64"},
                     {"rows-gemv-from=66", "rows-gemv-from", "rows-gemv-from must be an integer in 1…65"},
                     {"chunk=", "chunk", "chunk must be an integer"},
                     {"gemv-blocks-per-sm=5", "gemv-blocks-per-sm", "gemv-blocks-per-sm must be an integer in 1…4, got '5'"},
                     {"moe-tile-balance=1025", "moe-tile-balance", "moe-tile-balance must be an integer in 0…1024, got '1025'"},
                     {"moe-tile-claims-from=0", "moe-tile-claims-from", "moe-tile-claims-from must be an integer in 1…65, got '0'"},
                     {"moe-tile-claims-fixed=101", "moe-tile-claims-fixed", "moe-tile-claims-fixed must be an integer in 0…100, got '101'"},
                     {"gemv-smem-kib=228", "gemv-smem-kib", "gemv-smem-kib must be an integer in 16…227, got '228'"},
                     {"gemv-late-requests=some", "gemv-late-requests", "gemv-late-requests must be 'none', 'staged' or 'all', got 'some'"},
                     {"gemm-kernel=dense", "gemm-kernel", "gemm-kernel must be 'grouped', 'all', '0', 'wgmma'"},
                     {"persistent-decode=2", "persistent-decode", "persistent-decode must be '1', 'debug', 'trace' or '0'"},
                     {"=1", nullptr, "'=1': unknown option ''"}};
  for (const Bad& b : bad) {
    CudaOptions o;
    try {
      o.set(b.assignment);
      ADD_FAILURE() << b.assignment << " was accepted";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_EQ(what.rfind(b.message, 0), 0u) << b.assignment << ": " << what;
      EXPECT_EQ(what.find("--"), std::string::npos) << b.assignment << ": " << what;
      const auto* option = dynamic_cast<const OptionError*>(&e);
      if (b.field) {
        ASSERT_NE(option, nullptr) << b.assignment << ": not an OptionError: " << what;
        EXPECT_EQ(option->field(), b.field);
        EXPECT_EQ(option->message_naming("--cuda " + option->field()), "--cuda " + what) << b.assignment;
      } else {
        EXPECT_EQ(option, nullptr) << b.assignment << ": " << what;
      }
    }
    EXPECT_EQ(o.describe(), CudaOptions{}.describe()) << b.assignment;
  }
  try {
    CudaOptions().set("pd=0");
    ADD_FAILURE() << "pd=0 was accepted";
  } catch (const Error& e) {  // the message lists the names
    EXPECT_NE(std::string(e.what()).find("fuse, pdl, stream-gemv"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("prefill-rows"), std::string::npos) << e.what();
  }
}

TEST(CudaOptions, FlagsOverrideTheirVariables) {
  ScopedEnv a("LILY_CUDA_PDL", "0"), b("LILY_CUDA_MAX_BATCH", "8");
  const std::vector<std::string> flags = {"pdl=1", "max-batch=4", "max-batch=16"};  // the last one wins
  const CudaOptions o = CudaOptions::resolve(flags);
  EXPECT_TRUE(o.pdl);
  EXPECT_EQ(o.max_batch, 16);
  EXPECT_EQ(CudaOptions::resolve({}).max_batch, 8);  // without flags, the variable
  ScopedEnv bad("LILY_CUDA_FUSE", "yes");            // a bad variable is an error even with flags
  EXPECT_THROW(CudaOptions::resolve(flags), Error);
}

TEST(CudaOptions, TheCpuBackendChecksButIgnoresCudaFlags) {
  auto weights = load_model(test::demo_model_dir());
  const std::vector<std::string> good = {"pdl=0"}, bad = {"pdl=on"};
  EXPECT_EQ(make_backend(BackendKind::kCpu, weights, 1, resolve_cuda_options(BackendKind::kCpu, good))->name(), "cpu");
  EXPECT_THROW(resolve_cuda_options(BackendKind::kCpu, bad), Error);
  EXPECT_THROW(resolve_cuda_options(BackendKind::kAuto, bad), Error);
}

}  // namespace
}  // namespace lily
