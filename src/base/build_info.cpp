#include "base/build_info.h"

namespace lily {

#define LILY_STR2(x) #x
#define LILY_STR(x) LILY_STR2(x)

const char* build_commit() { return LILY_GIT_COMMIT; }

const char* build_version() { return LILY_VERSION; }

const char* build_type() { return LILY_BUILD_TYPE; }

const char* build_compiler() {
#if defined(__clang__)
  return "clang " LILY_STR(__clang_major__) "." LILY_STR(__clang_minor__) "." LILY_STR(__clang_patchlevel__);
#elif defined(__GNUC__)
  return "gcc " LILY_STR(__GNUC__) "." LILY_STR(__GNUC_MINOR__) "." LILY_STR(__GNUC_PATCHLEVEL__);
#else
  return "unknown";
#endif
}

bool build_has_cuda() { return LILY_BUILD_CUDA != 0; }

}  // namespace lily
