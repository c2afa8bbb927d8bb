// Build identity (the git commit the binary was configured from), kept in one translation unit so
// that a new commit recompiles one file, not the whole project.
#pragma once

namespace lily {

/// Short git commit hash of the source tree ("unknown" outside a git checkout).
const char* build_commit();

}  // namespace lily
