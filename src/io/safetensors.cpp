#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/file_util.h"

namespace lily {
namespace {

struct DTypeEntry {
  DType dtype;
  const char* name;
  size_t size;
};

constexpr DTypeEntry kDTypes[] = {
    {DType::kBF16, "BF16", 2},    {DType::kF16, "F16", 2},   {DType::kF32, "F32", 4},
    {DType::kF64, "F64", 8},      {DType::kU8, "U8", 1},     {DType::kI8, "I8", 1},
    {DType::kU16, "U16", 2},      {DType::kI16, "I16", 2},   {DType::kU32, "U32", 4},
    {DType::kI32, "I32", 4},      {DType::kU64, "U64", 8},   {DType::kI64, "I64", 8},
    {DType::kBool, "BOOL", 1},    {DType::kF8E4M3, "F8_E4M3", 1},
    {DType::kF8E5M2, "F8_E5M2", 1},
};

const DTypeEntry& entry_of(DType dtype) {
  for (const auto& e : kDTypes)
    if (e.dtype == dtype) return e;
  throw InternalError("dtype without a table entry");
}

std::string fname(const std::filesystem::path& p) { return p.filename().string(); }

[[noreturn]] void fail(const std::filesystem::path& file, const std::string& what) {
  throw CheckpointError(file.string() + ": " + what);
}

[[noreturn]] void fail_tensor(const std::filesystem::path& file, const std::string& tensor,
                              const std::string& what) {
  throw CheckpointError(file.string() + ": tensor " + tensor + ": " + what);
}

uint64_t read_le64(const std::byte* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

/// Non-negative integer from a JSON value, or nullopt.
std::optional<uint64_t> as_u64(const nlohmann::json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0) return static_cast<uint64_t>(v.get<int64_t>());
  return std::nullopt;
}

}  // namespace

const char* dtype_name(DType dtype) { return entry_of(dtype).name; }
size_t dtype_size(DType dtype) { return entry_of(dtype).size; }

std::optional<DType> parse_dtype(std::string_view name) {
  for (const auto& e : kDTypes)
    if (name == e.name) return e.dtype;
  return std::nullopt;
}

int64_t TensorInfo::numel() const {
  // A zero dimension makes the count 0 however large the others are (the header validator
  // accepts e.g. [2^62, 3, 0]); otherwise numel · dtype_size = nbytes bounds the product.
  for (int64_t d : shape)
    if (d == 0) return 0;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string TensorInfo::shape_string() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// --- MappedFile ---------------------------------------------------------------------------

void MappedFile::Free::operator()(std::byte* p) const { std::free(p); }

MappedFile::MappedFile(const std::filesystem::path& path, bool map) : path_(path), mapped_(map) {
  int fd = -1;
  try {
    fd = open_regular_file(path);  // O_NONBLOCK + fstat first: a FIFO must not block here
  } catch (const Error& e) {
    throw CheckpointError(e.what());
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail(path, std::string("cannot stat: ") + std::strerror(err));
  }
  size_ = static_cast<uint64_t>(st.st_size);
  dev_ = static_cast<uint64_t>(st.st_dev);
  ino_ = static_cast<uint64_t>(st.st_ino);
  mtime_s_ = static_cast<int64_t>(st.st_mtim.tv_sec);
  mtime_ns_ = static_cast<int64_t>(st.st_mtim.tv_nsec);
  if (size_ > 0 && map) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      fail(path, std::string("cannot memory-map: ") + std::strerror(err));
    }
    data_ = static_cast<const std::byte*>(p);
  } else if (size_ > 0) {
    // Page-aligned like a mapping, so every tensor keeps the alignment it would have there.
    const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
    const uint64_t rounded = (size_ + page - 1) / page * page;
    owned_.reset(static_cast<std::byte*>(std::aligned_alloc(page, rounded)));
    if (!owned_) {
      ::close(fd);
      fail(path, "cannot allocate " + std::to_string(size_) + " bytes to read the file into memory (weights read rather than mapped)");
    }
    uint64_t done = 0;
    while (done < size_) {
      const ssize_t n = ::pread(fd, owned_.get() + done, size_ - done, static_cast<off_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int err = n < 0 ? errno : 0;
        ::close(fd);
        fail(path, n < 0 ? std::string("read failed: ") + std::strerror(err)
                         : "shrank while being read (" + std::to_string(done) + " of " + std::to_string(size_) +
                               " bytes)");
      }
      done += static_cast<uint64_t>(n);
    }
    data_ = owned_.get();
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_ && mapped_) ::munmap(const_cast<std::byte*>(data_), size_);
}

std::optional<std::string> MappedFile::changed_on_disk() const {
  if (!mapped_) return std::nullopt;
  struct stat st {};
  if (::stat(path_.c_str(), &st) != 0)
    return path_.string() + " was removed or cannot be read (" + std::strerror(errno) + ")";
  if (static_cast<uint64_t>(st.st_dev) != dev_ || static_cast<uint64_t>(st.st_ino) != ino_)
    return path_.string() + " was replaced by another file";
  if (static_cast<uint64_t>(st.st_size) != size_)
    return path_.string() + " was " + (static_cast<uint64_t>(st.st_size) < size_ ? "truncated" : "resized") +
           " from " + std::to_string(size_) + " to " + std::to_string(st.st_size) + " bytes";
  if (static_cast<int64_t>(st.st_mtim.tv_sec) != mtime_s_ || static_cast<int64_t>(st.st_mtim.tv_nsec) != mtime_ns_)
    return path_.string() + " was modified (its mtime changed)";
  return std::nullopt;
}

// --- SafetensorsFile ----------------------------------------------------------------------

bool is_gguf_file(const std::filesystem::path& path) {
  int fd = -1;
  try {
    fd = open_regular_file(path);  // never blocks on a FIFO
  } catch (const Error&) {
    return false;
  }
  char magic[4] = {};
  const bool yes = ::read(fd, magic, 4) == 4 && std::memcmp(magic, "GGUF", 4) == 0;
  ::close(fd);
  return yes;
}

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path, bool map) : path_(path), map_(path, map) {
  parse_header();
}

const TensorInfo* SafetensorsFile::find(std::string_view name) const {
  auto it = by_name_.find(std::string(name));
  return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

void SafetensorsFile::parse_header() {
  const uint64_t size = map_.size();
  if (size >= 4 && std::memcmp(map_.data(), "GGUF", 4) == 0)
    fail(path_, "is a GGUF file (magic \"GGUF\"); lily reads MLX safetensors checkpoints only");
  if (size < 8) fail(path_, "truncated: " + std::to_string(size) + " bytes, too short for a safetensors header");
  const uint64_t header_len = read_le64(map_.data());
  if (header_len > size - 8)
    fail(path_, "header length " + std::to_string(header_len) + " runs past the end of the file (" +
                    std::to_string(size) + " bytes); truncated or not a safetensors file");
  const char* text = reinterpret_cast<const char*>(map_.data() + 8);

  // Parse, rejecting duplicate top-level names (the JSON library would keep only the last).
  std::set<std::string> seen;
  std::string duplicate;
  auto on_event = [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
    if (depth == 1 && event == nlohmann::json::parse_event_t::key && duplicate.empty()) {
      const auto& key = parsed.get_ref<const std::string&>();
      if (!seen.insert(key).second) duplicate = key;
    }
    return true;
  };
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text, text + header_len, on_event);
  } catch (const nlohmann::json::exception& e) {
    fail(path_, std::string("header is not valid UTF-8 JSON: ") + e.what());
  }
  if (!header.is_object()) fail(path_, "header is not a JSON object");
  if (!duplicate.empty()) fail_tensor(path_, duplicate, "appears twice in the header");

  const uint64_t data_start = 8 + header_len;
  const uint64_t data_size = size - data_start;
  std::vector<std::pair<uint64_t, size_t>> starts;  // (start offset, tensor index)
  for (auto& [name, desc] : header.items()) {
    if (name == "__metadata__") continue;
    if (!desc.is_object()) fail_tensor(path_, name, "header entry is not an object");
    TensorInfo t;
    t.name = name;
    t.file = fname(path_);
    auto dt = desc.find("dtype");
    if (dt == desc.end() || !dt->is_string()) fail_tensor(path_, name, "missing dtype");
    auto parsed = parse_dtype(dt->get<std::string>());
    if (!parsed) fail_tensor(path_, name, "unknown dtype " + dt->get<std::string>());
    t.dtype = *parsed;
    auto sh = desc.find("shape");
    if (sh == desc.end() || !sh->is_array()) fail_tensor(path_, name, "missing shape");
    // numel · element size, checked against overflow at every step.
    uint64_t bytes = dtype_size(t.dtype);
    bool overflow = false;
    for (const auto& d : *sh) {
      auto v = as_u64(d);
      if (!v || *v > uint64_t(std::numeric_limits<int64_t>::max()))
        fail_tensor(path_, name, "shape " + sh->dump() + " has a non-integer or negative dimension");
      t.shape.push_back(static_cast<int64_t>(*v));
      if (*v != 0 && bytes > std::numeric_limits<uint64_t>::max() / *v) overflow = true;
      else bytes *= *v;
    }
    // A zero dimension makes the tensor empty whatever came before it ([2^62, 4, 0]: 0 bytes).
    if (std::any_of(t.shape.begin(), t.shape.end(), [](int64_t d) { return d == 0; })) {
      bytes = 0;
      overflow = false;
    }
    auto off = desc.find("data_offsets");
    if (off == desc.end() || !off->is_array() || off->size() != 2 || !as_u64((*off)[0]) ||
        !as_u64((*off)[1]))
      fail_tensor(path_, name, "data_offsets must be two non-negative integers");
    uint64_t start = *as_u64((*off)[0]), end = *as_u64((*off)[1]);
    if (end < start)
      fail_tensor(path_, name, "data_offsets [" + std::to_string(start) + ", " + std::to_string(end) + "] end before start");
    if (end > data_size)
      fail_tensor(path_, name, "data_offsets [" + std::to_string(start) + ", " + std::to_string(end) +
                                   "] run past the data section (" + std::to_string(data_size) +
                                   " bytes); file truncated?");
    if (overflow || bytes != end - start)
      fail_tensor(path_, name, "shape " + t.shape_string() + " of " + dtype_name(t.dtype) + " needs " +
                                   (overflow ? std::string("more than 2^64") : std::to_string(bytes)) +
                                   " bytes but data_offsets cover " + std::to_string(end - start));
    t.nbytes = end - start;
    t.data = map_.data() + data_start + start;
    if (reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) != 0 && t.nbytes > 0) {
      // Misaligned for its element type: keep an aligned private copy so typed views are valid.
      aligned_copies_.emplace_back(new std::byte[t.nbytes]);
      std::memcpy(aligned_copies_.back().get(), t.data, t.nbytes);
      t.data = aligned_copies_.back().get();
    }
    starts.emplace_back(start, tensors_.size());
    by_name_.emplace(name, tensors_.size());
    tensors_.push_back(std::move(t));
  }
  check_ranges(starts);
}

void SafetensorsFile::check_ranges(const std::vector<std::pair<uint64_t, size_t>>& starts_in) const {
  auto starts = starts_in;
  std::sort(starts.begin(), starts.end());
  uint64_t prev_end = 0;
  const TensorInfo* prev = nullptr;
  for (const auto& [start, index] : starts) {
    const TensorInfo& t = tensors_[index];
    if (t.nbytes == 0) continue;
    if (prev && start < prev_end)
      fail_tensor(path_, t.name, "data range overlaps tensor " + prev->name);
    prev_end = start + t.nbytes;
    prev = &t;
  }
}

}  // namespace lily
