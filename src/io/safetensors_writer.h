// Writer of safetensors files (docs/model.md §2.1) whose tensor list is known up front:
// the header is written first, then tensor data is streamed in pieces (positional writes, any
// order, any thread), so a tensor never has to be in memory as a whole. CheckpointWriter adds
// sharding: several files plus model.safetensors.index.json (weight_map, metadata.total_size).
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "io/safetensors.h"

namespace lily {

/// One tensor to be written: its name, dtype and shape. Bytes = numel · dtype_size(dtype).
struct TensorDecl {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;

  int64_t numel() const;
  uint64_t nbytes() const;
};

/// Writes one safetensors file. The constructor writes the 8-byte header length and the JSON
/// header (padded with spaces to a multiple of 8 bytes, as the format allows); the data section
/// is laid out contiguously, without gaps, tensors whose byte size is a multiple of 8 first (so
/// every tensor starts aligned to its element size). Data is then supplied with write(), which
/// is thread-safe. finish() checks that every tensor received exactly its byte count.
/// On destruction without a successful finish() the partial file is removed.
class SafetensorsWriter {
 public:
  /// Creates (truncates) `path`. `metadata` becomes the header's `__metadata__` object
  /// (omitted when empty). Throws lily::Error when the file cannot be created or two tensors
  /// share a name.
  SafetensorsWriter(const std::filesystem::path& path, std::vector<TensorDecl> tensors,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  /// Index (in the order given to the constructor) of tensor `name`; throws InternalError if absent.
  size_t index_of(std::string_view name) const;
  /// Writes `bytes` at byte `offset` inside tensor `tensor`'s data. Thread-safe. Throws
  /// InternalError if the piece runs past the tensor, lily::Error on an I/O failure.
  void write(size_t tensor, uint64_t offset, std::span<const std::byte> bytes);
  /// Checks completeness (every tensor's written byte count equals its size), flushes and
  /// closes. Throws InternalError naming the first incomplete tensor, lily::Error on I/O failure.
  void finish();

  const std::filesystem::path& path() const { return path_; }
  const std::vector<TensorDecl>& tensors() const { return tensors_; }
  /// Bytes of the data section (sum of the tensors' sizes).
  uint64_t data_bytes() const { return data_bytes_; }
  /// Bytes of the whole file (8 + header + data).
  uint64_t file_bytes() const { return data_start_ + data_bytes_; }

 private:
  std::string build_header(const std::map<std::string, std::string>& metadata);

  std::filesystem::path path_;
  std::vector<TensorDecl> tensors_;
  std::unordered_map<std::string, size_t> by_name_;
  std::vector<uint64_t> offsets_;  ///< data-section offset of each tensor
  std::unique_ptr<std::atomic<uint64_t>[]> written_;
  uint64_t data_start_ = 0;  ///< 8 + padded header length
  uint64_t data_bytes_ = 0;
  int fd_ = -1;
  bool finished_ = false;
};

/// Assignment of tensors to shard files.
struct ShardPlan {
  std::vector<std::string> file_names;           ///< "model.safetensors" or "model-0000i-of-0000n.safetensors"
  std::vector<std::vector<TensorDecl>> shards;   ///< tensors of each file, in the given order
};

/// Splits `tensors` (kept in order) into files of at most `max_shard_bytes` of data each
/// (a tensor larger than the limit gets a file of its own). max_shard_bytes == 0 means one
/// file called model.safetensors; otherwise the files are model-%05d-of-%05d.safetensors
/// (also when only one results).
ShardPlan plan_shards(const std::vector<TensorDecl>& tensors, uint64_t max_shard_bytes);

/// Writes a checkpoint's tensors into one or several safetensors files in `dir` (see
/// plan_shards) and, when sharded, model.safetensors.index.json with
/// {"metadata": {"total_size": <sum of tensor bytes>}, "weight_map": {name: file}}.
/// write() is thread-safe; finish() completes every file and then writes the index.
class CheckpointWriter {
 public:
  /// Where a tensor goes: its file and its index in that file.
  struct Target {
    SafetensorsWriter* file = nullptr;
    size_t index = 0;
  };

  /// Creates the files in `dir` (which must exist). Throws lily::Error on I/O failure.
  CheckpointWriter(const std::filesystem::path& dir, const std::vector<TensorDecl>& tensors,
                   uint64_t max_shard_bytes, const std::map<std::string, std::string>& metadata = {});

  /// The target of tensor `name`; throws InternalError if it was not declared.
  Target target(std::string_view name) const;
  /// Writes a piece of a tensor (see SafetensorsWriter::write). Thread-safe.
  static void write(const Target& target, uint64_t offset, std::span<const std::byte> bytes) {
    target.file->write(target.index, offset, bytes);
  }
  /// Finishes every file, then writes the index when sharded. Throws as SafetensorsWriter::finish.
  void finish();

  bool sharded() const { return sharded_; }
  const std::vector<std::string>& file_names() const { return plan_.file_names; }
  /// Sum of all tensors' data bytes (the index's metadata.total_size).
  uint64_t total_data_bytes() const;
  /// Sum of all files' sizes.
  uint64_t total_file_bytes() const;

 private:
  std::filesystem::path dir_;
  ShardPlan plan_;
  bool sharded_ = false;
  std::vector<std::unique_ptr<SafetensorsWriter>> files_;
  std::unordered_map<std::string, Target> targets_;
};

}  // namespace lily
