// Memory-mapped reader of one safetensors file (docs/model.md §2.1): an 8-byte
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

/// The bytes of a whole file, read-only (RAII): either a memory mapping (the pages come from the
/// page cache on first touch and are shared with other processes) or, with `map` false, a private
/// page-aligned heap copy read at open (`--no-mmap`: the whole file resident in anonymous memory,
/// but a later truncation or rewrite of the file can no longer fault the process with SIGBUS).
class MappedFile {
 public:
  /// Opens `path` (O_NONBLOCK, so a FIFO or device is refused at once instead of blocking) and
  /// maps it, or reads it whole when `map` is false. Records the file's identity (device, inode,
  /// size, mtime) for changed_on_disk(). Throws CheckpointError naming the file when it cannot
  /// be opened, is not a regular file, or cannot be mapped or read.
  explicit MappedFile(const std::filesystem::path& path, bool map = true);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const { return data_; }
  uint64_t size() const { return size_; }
  /// True for a memory mapping, false for a heap copy.
  bool mapped() const { return mapped_; }

  /// For a mapping: why the mapped bytes can no longer be trusted (PATH "was truncated from A to
  /// B bytes", "was modified", "was replaced by another file", "was removed"), found by one
  /// stat(2) of the path compared with what was recorded at open; nullopt while unchanged.
  /// Always nullopt for a heap copy (changes on disk cannot affect it). Never touches the mapped
  /// pages, so it cannot fault. Thread-safe.
  std::optional<std::string> changed_on_disk() const;

 private:
  struct Free {
    void operator()(std::byte* p) const;
  };
  std::filesystem::path path_;
  const std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  bool mapped_ = true;
  std::unique_ptr<std::byte, Free> owned_;  ///< the heap copy when !mapped_
  uint64_t dev_ = 0, ino_ = 0;
  int64_t mtime_s_ = 0, mtime_ns_ = 0;
};

/// One opened, fully validated safetensors file.
class SafetensorsFile {
 public:
  /// Opens and validates `path`: header length inside the file, valid UTF-8 JSON object,
  /// no duplicate names, known dtypes, non-negative shapes, shape × element size equal to the
  /// byte range, every range inside the data section, no two ranges overlapping; the
  /// `__metadata__` entry is skipped. A file starting with the GGUF magic is reported as such.
  /// Throws CheckpointError naming the file (and the tensor, where one is at fault).
  /// `map` false reads the file into memory instead of mapping it (see MappedFile).
  explicit SafetensorsFile(const std::filesystem::path& path, bool map = true);

  const std::filesystem::path& path() const { return path_; }
  /// Total file size in bytes.
  uint64_t file_size() const { return map_.size(); }
  /// Tensors in header order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  /// The tensor called `name`, or nullptr.
  const TensorInfo* find(std::string_view name) const;
  /// True when the tensors point into a memory mapping (false: into a heap copy).
  bool mapped() const { return map_.mapped(); }
  /// See MappedFile::changed_on_disk.
  std::optional<std::string> changed_on_disk() const { return map_.changed_on_disk(); }

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
