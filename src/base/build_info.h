// Build identity (the git commit the binary was configured from, the version, the build type,
// the compiler and whether the CUDA backend is in), kept in one translation unit so that a new
// commit recompiles one file, not the whole project.
#pragma once

namespace lily {

/// Short git commit hash of the source tree ("unknown" outside a git checkout).
const char* build_commit();

/// The project version ("0.1.0"), from CMake's project(VERSION).
const char* build_version();

/// CMake's build type ("Release", "Debug", …).
const char* build_type();

/// The compiler and its version ("gcc 12.2.0", "clang 16.0.6").
const char* build_compiler();

/// True when the CUDA backend was compiled in.
bool build_has_cuda();

}  // namespace lily
