#include "base/build_info.h"

namespace lily {

const char* build_commit() { return LILY_GIT_COMMIT; }

}  // namespace lily
