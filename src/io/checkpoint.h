// A checkpoint directory's tensors (reference/model.md §2.1): either a sharded
// `model.safetensors.index.json` + shards, or a single `model.safetensors`; all memory-mapped
// and validated when opened. Lookup by tensor name across shards.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "io/safetensors.h"

namespace lily {

class Checkpoint {
 public:
  /// Opens `dir`. With `model.safetensors.index.json`: its weight_map must name shards that
  /// exist (plain file names inside `dir`), each shard must hold exactly the tensors the index
  /// assigns to it, and no tensor may be in two shards. Otherwise `model.safetensors` is used.
  /// Throws CheckpointError naming the file and tensor at fault; when neither file exists the
  /// message says so and mentions *.gguf or pytorch_model*.bin files found instead.
  explicit Checkpoint(const std::filesystem::path& dir);

  const std::filesystem::path& dir() const { return dir_; }
  /// The tensor called `name` (any shard), or nullptr.
  const TensorInfo* find(std::string_view name) const;
  /// The tensor called `name`; throws CheckpointError "missing tensor …" when absent.
  const TensorInfo& get(std::string_view name) const;
  /// All tensors, sorted by name.
  std::vector<const TensorInfo*> tensors() const;
  size_t tensor_count() const { return by_name_.size(); }
  /// The opened safetensors files (one, or the shards in file-name order).
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }
  /// Sum of the safetensors files' sizes in bytes.
  uint64_t bytes_on_disk() const;
  /// True when opened from model.safetensors.index.json.
  bool sharded() const { return sharded_; }

 private:
  void open_sharded(const std::filesystem::path& index_path);
  void open_single(const std::filesystem::path& file);
  void add_file(std::unique_ptr<SafetensorsFile> file);
  [[noreturn]] void fail_no_weights() const;

  std::filesystem::path dir_;
  bool sharded_ = false;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::unordered_map<std::string, const TensorInfo*> by_name_;
};

}  // namespace lily
