// The committed demo model's tokenizer, one copy for the unit tests and the libFuzzer targets.
// Header-only and needing only the compile-time LILY_SOURCE_DIR, because the fuzz targets link
// neither GoogleTest nor lily_test_support; whoever calls it links lily_text.
#pragma once
#include <cstdlib>
#include <filesystem>
#include <memory>

#include "text/tokenizer.h"

namespace lily::test {

/// models/demo/tokenizer.json, loaded on the first call and shared for the rest of the process
/// (a Tokenizer is immutable, safe from several threads). The repository root is the
/// LILY_SOURCE_DIR environment variable when set (a fuzz binary run against another checkout),
/// else the compile-time LILY_SOURCE_DIR. Throws what Tokenizer::from_file throws for a missing
/// or malformed file.
inline const std::shared_ptr<const Tokenizer>& demo_tokenizer() {
  static const std::shared_ptr<const Tokenizer> tokenizer = [] {
    const char* env = std::getenv("LILY_SOURCE_DIR");
    const std::filesystem::path root = env ? env : LILY_SOURCE_DIR;
    return Tokenizer::from_file(root / "models/demo/tokenizer.json");
  }();
  return tokenizer;
}

}  // namespace lily::test
