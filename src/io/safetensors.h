// Memory-mapped reader of one safetensors file (reference/model.md §2.1): an 8-byte
// little-endian header length N, N bytes of UTF-8 JSON mapping tensor name →
// {dtype, shape, data_offsets:[start, end]} (offsets relative to the data section at 8 + N),
// then the data section. The header is validated completely when the file is opened.
#pragma once
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace lily {

/// Element types a safetensors header may declare. All are recognised; the loader later
/// rejects the ones a qwen3_5_moe MLX checkpoint must not contain (F8_*, F16, …).
enum class DType {
  kBF16, kF16, kF32, kF64,
  kU8, kI8, kU16, kI16, kU32, kI32, kU64, kI64,
  kBool, kF8E4M3, kF8E5M2,
};

/// The header spelling of a dtype ("BF16", "F8_E4M3", …).
const char* dtype_name(DType dtype);
/// Bytes per element (1 for BOOL and the F8 types).
size_t dtype_size(DType dtype);
/// Parses a header dtype string; std::nullopt when unknown.
std::optional<DType> parse_dtype(std::string_view name);

/// One tensor of a safetensors file. `data` points into the file mapping (or, when the file
/// stores it at an address not aligned to its element size, into an aligned private copy).
struct TensorInfo {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t nbytes = 0;              ///< end − start = numel · dtype_size
  const std::byte* data = nullptr;  ///< nbytes of little-endian row-major data
  std::string file;                 ///< file name (no directory), for error messages

  int64_t numel() const;
  /// "[8192, 4, 1]"
  std::string shape_string() const;
};

/// A read-only memory mapping of a whole file (RAII).
class MappedFile {
 public:
  /// Maps `path` read-only. Throws CheckpointError naming the file when it cannot be opened.
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }

 private:
  const std::byte* data_ = nullptr;
  uint64_t size_ = 0;
};

/// One opened, fully validated safetensors file.
class SafetensorsFile {
 public:
  /// Opens and validates `path`: header length inside the file, valid UTF-8 JSON object,
  /// no duplicate names, known dtypes, non-negative shapes, shape × element size equal to the
  /// byte range, every range inside the data section, no two ranges overlapping; the
  /// `__metadata__` entry is skipped. A file starting with the GGUF magic is reported as such.
  /// Throws CheckpointError naming the file (and the tensor, where one is at fault).
  explicit SafetensorsFile(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }
  /// Total file size in bytes.
  uint64_t file_size() const { return map_.size(); }
  /// Tensors in header order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  /// The tensor called `name`, or nullptr.
  const TensorInfo* find(std::string_view name) const;

 private:
  void parse_header();
  void check_ranges(const std::vector<std::pair<uint64_t, size_t>>& starts) const;

  std::filesystem::path path_;
  MappedFile map_;
  std::vector<TensorInfo> tensors_;
  std::unordered_map<std::string, size_t> by_name_;
  std::vector<std::unique_ptr<std::byte[]>> aligned_copies_;
};

/// True when the first bytes of the file at `path` are the GGUF magic "GGUF".
bool is_gguf_file(const std::filesystem::path& path);

}  // namespace lily
