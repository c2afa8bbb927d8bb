#include "io/checkpoint.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "base/file_util.h"

namespace lily {
namespace {

constexpr const char* kIndexName = "model.safetensors.index.json";
constexpr const char* kSingleName = "model.safetensors";

nlohmann::json read_json(const std::filesystem::path& path) {
  std::string text;
  try {
    text = read_regular_file(path);
  } catch (const Error& e) {
    throw CheckpointError(e.what());
  }
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(path.string() + ": not valid JSON: " + e.what());
  }
}

/// A shard name must be a plain file name inside the checkpoint directory.
bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\\') == std::string::npos && name.find('\0') == std::string::npos;
}

}  // namespace

Checkpoint::Checkpoint(const std::filesystem::path& dir, bool map) : dir_(dir), map_(map) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec))
    throw CheckpointError(dir.string() + ": not a directory (expected a checkpoint directory)");
  // symlink_status: a FIFO or a dangling link still "exists" and is refused by name when opened.
  if (std::filesystem::exists(std::filesystem::symlink_status(dir / kIndexName, ec))) open_sharded(dir / kIndexName);
  else if (std::filesystem::exists(std::filesystem::symlink_status(dir / kSingleName, ec))) open_single(dir / kSingleName);
  else fail_no_weights();
}

void Checkpoint::fail_no_weights() const {
  std::vector<std::string> gguf, bins;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    std::string name = entry.path().filename().string();
    if (entry.path().extension() == ".gguf") gguf.push_back(name);
    if (name.rfind("pytorch_model", 0) == 0 && entry.path().extension() == ".bin") bins.push_back(name);
  }
  std::string msg = dir_.string() + ": no " + kIndexName + " or " + kSingleName;
  if (!gguf.empty())
    msg += "; found GGUF file " + gguf.front() + ": GGUF checkpoints are not supported, lily reads MLX safetensors";
  else if (!bins.empty())
    msg += "; found PyTorch " + bins.front() + ": .bin checkpoints are not supported, lily reads MLX safetensors";
  throw CheckpointError(msg);
}

void Checkpoint::open_single(const std::filesystem::path& file) {
  add_file(std::make_unique<SafetensorsFile>(file, map_));
}

void Checkpoint::open_sharded(const std::filesystem::path& index_path) {
  sharded_ = true;
  const nlohmann::json index = read_json(index_path);
  const std::string where = index_path.string();
  if (!index.is_object() || !index.contains("weight_map") || !index["weight_map"].is_object())
    throw CheckpointError(where + ": no weight_map object");
  std::map<std::string, std::set<std::string>> by_shard;  // shard → tensors listed
  for (const auto& [tensor, shard] : index["weight_map"].items()) {
    if (!shard.is_string())
      throw CheckpointError(where + ": weight_map entry for tensor " + tensor + " is not a file name");
    const std::string shard_name = shard.get<std::string>();
    if (!is_plain_file_name(shard_name))
      throw CheckpointError(where + ": tensor " + tensor + " maps to " + shard.dump() +  // quoted: a NUL shows as \u0000
                            ", which is not a plain file name inside the checkpoint directory");
    by_shard[shard_name].insert(tensor);
  }
  if (by_shard.empty()) throw CheckpointError(where + ": weight_map is empty");
  // Open every shard first so that a tensor stored twice is reported as such.
  for (const auto& [shard_name, listed] : by_shard) {
    std::error_code ec;
    if (!std::filesystem::exists(dir_ / shard_name, ec))
      throw CheckpointError(where + ": shard " + shard_name + " (tensor " + *listed.begin() +
                            ", …) does not exist");
    add_file(std::make_unique<SafetensorsFile>(dir_ / shard_name, map_));  // refuses a FIFO by name
  }
  for (const auto& file : files_) {
    const auto& listed = by_shard.at(file->path().filename().string());
    for (const auto& t : file->tensors())
      if (!listed.count(t.name))
        throw CheckpointError(file->path().string() + ": tensor " + t.name +
                              " is not listed for this shard in " + kIndexName);
    for (const auto& tensor : listed)
      if (!file->find(tensor))
        throw CheckpointError(where + ": tensor " + tensor + " is listed in shard " +
                              file->path().filename().string() + " but that file does not contain it");
  }
}

void Checkpoint::add_file(std::unique_ptr<SafetensorsFile> file) {
  for (const auto& t : file->tensors()) {
    auto [it, inserted] = by_name_.emplace(t.name, &t);
    if (!inserted)
      throw CheckpointError(dir_.string() + ": tensor " + t.name + " appears in two shards: " +
                            it->second->file + " and " + t.file);
  }
  files_.push_back(std::move(file));
}

const TensorInfo* Checkpoint::find(std::string_view name) const {
  auto it = by_name_.find(std::string(name));
  return it == by_name_.end() ? nullptr : it->second;
}

const TensorInfo& Checkpoint::get(std::string_view name) const {
  const TensorInfo* t = find(name);
  if (!t) throw CheckpointError(dir_.string() + ": missing tensor " + std::string(name));
  return *t;
}

std::vector<const TensorInfo*> Checkpoint::tensors() const {
  std::vector<const TensorInfo*> all;
  all.reserve(by_name_.size());
  for (const auto& [name, t] : by_name_) all.push_back(t);
  std::sort(all.begin(), all.end(), [](auto* a, auto* b) { return a->name < b->name; });
  return all;
}

std::optional<std::string> Checkpoint::changed_on_disk() const {
  for (const auto& f : files_)
    if (auto why = f->changed_on_disk()) return why;
  return std::nullopt;
}

uint64_t Checkpoint::bytes_on_disk() const {
  uint64_t total = 0;
  for (const auto& f : files_) total += f->file_size();
  return total;
}

}  // namespace lily
