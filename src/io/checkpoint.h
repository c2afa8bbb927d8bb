// A checkpoint directory's tensors (docs/model.md §2.1): either a sharded
// `model.safetensors.index.json` + shards, or a single `model.safetensors`; all memory-mapped
// and validated when opened. Lookup by tensor name across shards.
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
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
  /// message says so and mentions *.gguf or pytorch_model*.bin files found instead. A weights
  /// file that is not a regular file (a FIFO, a directory) is refused at once, never read.
  /// `map` false reads every safetensors file into memory instead of mapping it (`--no-mmap`).
  explicit Checkpoint(const std::filesystem::path& dir, bool map = true);

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
  /// True when the tensors point into memory mappings of the files (false: heap copies).
  bool mapped() const { return map_; }
  /// For a mapped checkpoint: the first safetensors file that was truncated, resized, modified,
  /// replaced or removed since it was opened, as one line ("DIR/model.safetensors was truncated
  /// from A to B bytes"), after which reading its tensors may fault (SIGBUS) or see other data;
  /// nullopt while all are unchanged, and always for a checkpoint read into memory. Costs one
  /// stat(2) per file, never touches the mapped pages; thread-safe.
  std::optional<std::string> changed_on_disk() const;

 private:
  void open_sharded(const std::filesystem::path& index_path);
  void open_single(const std::filesystem::path& file);
  void add_file(std::unique_ptr<SafetensorsFile> file);
  [[noreturn]] void fail_no_weights() const;

  std::filesystem::path dir_;
  bool sharded_ = false;
  bool map_ = true;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::unordered_map<std::string, const TensorInfo*> by_name_;
};

}  // namespace lily
