// Safetensors writer: header first, data by positional writes (see safetensors_writer.h).
#include "io/safetensors_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>

#include <nlohmann/json.hpp>

#include "base/error.h"

namespace lily {
namespace {

/// Writes all of `size` bytes at `offset`, retrying on short writes and EINTR.
void pwrite_all(int fd, const std::byte* data, uint64_t size, uint64_t offset,
                const std::filesystem::path& path) {
  while (size > 0) {
    ssize_t n = ::pwrite(fd, data, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw Error("writing " + path.string() + ": " + std::strerror(errno));
    }
    data += n;
    size -= static_cast<uint64_t>(n);
    offset += static_cast<uint64_t>(n);
  }
}

}  // namespace

int64_t TensorDecl::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

uint64_t TensorDecl::nbytes() const { return static_cast<uint64_t>(numel()) * dtype_size(dtype); }

SafetensorsWriter::SafetensorsWriter(const std::filesystem::path& path, std::vector<TensorDecl> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path), tensors_(std::move(tensors)) {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (!by_name_.emplace(tensors_[i].name, i).second)
      throw Error("safetensors writer: tensor " + tensors_[i].name + " declared twice for " + path.string());
  }
  written_ = std::make_unique<std::atomic<uint64_t>[]>(tensors_.size());
  for (size_t i = 0; i < tensors_.size(); ++i) written_[i] = 0;
  std::string header = build_header(metadata);
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw Error("cannot create " + path.string() + ": " + std::strerror(errno));
  uint64_t n = header.size();
  std::byte prefix[8];
  for (int i = 0; i < 8; ++i) prefix[i] = static_cast<std::byte>((n >> (8 * i)) & 0xff);
  try {
    pwrite_all(fd_, prefix, 8, 0, path_);
    pwrite_all(fd_, reinterpret_cast<const std::byte*>(header.data()), n, 8, path_);
  } catch (...) {  // the destructor does not run for a throwing constructor
    ::close(fd_);
    std::error_code ec;
    std::filesystem::remove(path_, ec);
    throw;
  }
  data_start_ = 8 + n;
}

SafetensorsWriter::~SafetensorsWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_) {
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
}

std::string SafetensorsWriter::build_header(const std::map<std::string, std::string>& metadata) {
  // Data order: tensors whose size is a multiple of 8 first (keeps every start aligned), then
  // the rest, each group in declaration order.
  std::vector<size_t> order(tensors_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_partition(order.begin(), order.end(),
                        [&](size_t i) { return tensors_[i].nbytes() % 8 == 0; });
  offsets_.assign(tensors_.size(), 0);
  nlohmann::json doc = nlohmann::json::object();
  if (!metadata.empty()) doc["__metadata__"] = metadata;
  uint64_t cursor = 0;
  for (size_t i : order) {
    const TensorDecl& t = tensors_[i];
    offsets_[i] = cursor;
    doc[t.name] = {{"dtype", dtype_name(t.dtype)},
                   {"shape", t.shape},
                   {"data_offsets", {cursor, cursor + t.nbytes()}}};
    cursor += t.nbytes();
  }
  data_bytes_ = cursor;
  std::string header = doc.dump();
  while (header.size() % 8 != 0) header.push_back(' ');
  return header;
}

size_t SafetensorsWriter::index_of(std::string_view name) const {
  auto it = by_name_.find(std::string(name));
  if (it == by_name_.end())
    throw InternalError("safetensors writer: " + std::string(name) + " is not declared in " + path_.string());
  return it->second;
}

void SafetensorsWriter::write(size_t tensor, uint64_t offset, std::span<const std::byte> bytes) {
  LILY_CHECK(tensor < tensors_.size());
  const uint64_t size = tensors_[tensor].nbytes();
  if (offset > size || bytes.size() > size - offset)
    throw InternalError("safetensors writer: piece [" + std::to_string(offset) + ", " +
                        std::to_string(offset + bytes.size()) + ") runs past " + tensors_[tensor].name +
                        " (" + std::to_string(size) + " bytes)");
  pwrite_all(fd_, bytes.data(), bytes.size(), data_start_ + offsets_[tensor] + offset, path_);
  written_[tensor] += bytes.size();
}

void SafetensorsWriter::finish() {
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (written_[i] != tensors_[i].nbytes())
      throw InternalError("safetensors writer: " + tensors_[i].name + " got " + std::to_string(written_[i].load()) +
                          " of " + std::to_string(tensors_[i].nbytes()) + " bytes in " + path_.string());
  }
  // A file whose last tensors are empty must still be as long as its header says.
  if (::ftruncate(fd_, static_cast<off_t>(file_bytes())) != 0)
    throw Error("writing " + path_.string() + ": " + std::strerror(errno));
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) throw Error("closing " + path_.string() + ": " + std::strerror(errno));
  finished_ = true;
}

ShardPlan plan_shards(const std::vector<TensorDecl>& tensors, uint64_t max_shard_bytes) {
  ShardPlan plan;
  if (max_shard_bytes == 0) {
    plan.file_names.push_back("model.safetensors");
    plan.shards.push_back(tensors);
    return plan;
  }
  uint64_t in_current = 0;
  for (const TensorDecl& t : tensors) {
    if (plan.shards.empty() || (in_current > 0 && in_current + t.nbytes() > max_shard_bytes)) {
      plan.shards.emplace_back();
      in_current = 0;
    }
    plan.shards.back().push_back(t);
    in_current += t.nbytes();
  }
  if (plan.shards.empty()) plan.shards.emplace_back();
  const size_t n = plan.shards.size();
  for (size_t i = 0; i < n; ++i) {
    char name[64];
    std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, n);
    plan.file_names.push_back(name);
  }
  return plan;
}

CheckpointWriter::CheckpointWriter(const std::filesystem::path& dir, const std::vector<TensorDecl>& tensors,
                                   uint64_t max_shard_bytes, const std::map<std::string, std::string>& metadata)
    : dir_(dir), plan_(plan_shards(tensors, max_shard_bytes)), sharded_(max_shard_bytes != 0) {
  for (size_t f = 0; f < plan_.shards.size(); ++f) {
    files_.push_back(std::make_unique<SafetensorsWriter>(dir / plan_.file_names[f], plan_.shards[f], metadata));
    for (size_t i = 0; i < plan_.shards[f].size(); ++i) {
      if (!targets_.emplace(plan_.shards[f][i].name, Target{files_.back().get(), i}).second)
        throw Error("checkpoint writer: tensor " + plan_.shards[f][i].name + " declared twice");
    }
  }
}

CheckpointWriter::Target CheckpointWriter::target(std::string_view name) const {
  auto it = targets_.find(std::string(name));
  if (it == targets_.end()) throw InternalError("checkpoint writer: " + std::string(name) + " is not declared");
  return it->second;
}

uint64_t CheckpointWriter::total_data_bytes() const {
  uint64_t total = 0;
  for (const auto& f : files_) total += f->data_bytes();
  return total;
}

uint64_t CheckpointWriter::total_file_bytes() const {
  uint64_t total = 0;
  for (const auto& f : files_) total += f->file_bytes();
  return total;
}

void CheckpointWriter::finish() {
  for (auto& f : files_) f->finish();
  if (!sharded_) return;
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t f = 0; f < plan_.shards.size(); ++f)
    for (const TensorDecl& t : plan_.shards[f]) weight_map[t.name] = plan_.file_names[f];
  nlohmann::json index = {{"metadata", {{"total_size", total_data_bytes()}}}, {"weight_map", weight_map}};
  const auto path = dir_ / "model.safetensors.index.json";
  std::ofstream out(path);
  out << index.dump(2) << "\n";
  out.close();
  if (!out) throw Error("writing " + path.string() + " failed");
}

}  // namespace lily
