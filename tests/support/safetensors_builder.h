// Test-side safetensors writer: builds files tensor by tensor (optionally from an existing file)
// and can emit deliberately broken headers. Independent of lily's reader and of `lily synth`.
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "support/test_support.h"  // write_file, read_file

namespace lily::test {

/// One tensor to write: name, header dtype string, shape, raw little-endian bytes.
struct BuiltTensor {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

class SafetensorsBuilder {
 public:
  /// Reads every tensor of an existing safetensors file (trusted input, minimal checks).
  static SafetensorsBuilder from_file(const std::filesystem::path& path);

  /// Appends (or replaces, when the name exists) a tensor.
  SafetensorsBuilder& add(const std::string& name, const std::string& dtype, std::vector<int64_t> shape,
                          std::string bytes);
  /// Removes a tensor; returns false when absent.
  bool remove(const std::string& name);
  BuiltTensor* find(const std::string& name);
  std::vector<BuiltTensor>& tensors() { return tensors_; }

  /// The header JSON this builder would write (offsets packed in order, no padding between).
  nlohmann::json header() const;
  /// Serialises `header` (which may have been edited to be inconsistent) plus the data.
  std::string serialize(const nlohmann::json& header) const;
  std::string serialize() const { return serialize(header()); }
  void write(const std::filesystem::path& path) const;

 private:
  std::vector<BuiltTensor> tensors_;
};

/// Bytes of `n` BF16 values all equal to `value`.
std::string bf16_bytes(size_t n, float value);
/// Bytes of F32 values.
std::string f32_bytes(const std::vector<float>& values);

}  // namespace lily::test
