#include "support/safetensors_builder.h"

#include <cstring>
#include <stdexcept>

#include "base/file_util.h"

namespace lily::test {

SafetensorsBuilder SafetensorsBuilder::from_file(const std::filesystem::path& path) {
  const std::string all = read_regular_file(path);
  if (all.size() < 8) throw std::runtime_error("from_file: too short: " + path.string());
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(all[i]);
  auto header = nlohmann::json::parse(all.substr(8, n));
  SafetensorsBuilder b;
  for (auto& [name, desc] : header.items()) {
    if (name == "__metadata__") continue;
    uint64_t start = desc["data_offsets"][0], end = desc["data_offsets"][1];
    b.add(name, desc["dtype"], desc["shape"].get<std::vector<int64_t>>(), all.substr(8 + n + start, end - start));
  }
  return b;
}

SafetensorsBuilder& SafetensorsBuilder::add(const std::string& name, const std::string& dtype,
                                            std::vector<int64_t> shape, std::string bytes) {
  if (BuiltTensor* t = find(name)) {
    *t = {name, dtype, std::move(shape), std::move(bytes)};
  } else {
    tensors_.push_back({name, dtype, std::move(shape), std::move(bytes)});
  }
  return *this;
}

bool SafetensorsBuilder::remove(const std::string& name) {
  for (auto it = tensors_.begin(); it != tensors_.end(); ++it)
    if (it->name == name) {
      tensors_.erase(it);
      return true;
    }
  return false;
}

BuiltTensor* SafetensorsBuilder::find(const std::string& name) {
  for (auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

nlohmann::json SafetensorsBuilder::header() const {
  nlohmann::json h = nlohmann::json::object();
  h["__metadata__"] = {{"format", "test"}};
  uint64_t offset = 0;
  for (const auto& t : tensors_) {
    h[t.name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  return h;
}

std::string SafetensorsBuilder::serialize(const nlohmann::json& header) const {
  std::string text = header.dump();
  while ((8 + text.size()) % 8 != 0) text += ' ';  // keep the data section 8-byte aligned
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += text;
  for (const auto& t : tensors_) out += t.bytes;
  return out;
}

void SafetensorsBuilder::write(const std::filesystem::path& path) const { write_file(path, serialize()); }

std::string bf16_bytes(size_t n, float value) {
  uint32_t u;
  std::memcpy(&u, &value, 4);
  uint16_t h = static_cast<uint16_t>(u >> 16);  // exact for the test values used
  std::string out(2 * n, '\0');
  for (size_t i = 0; i < n; ++i) std::memcpy(&out[2 * i], &h, 2);
  return out;
}

std::string f32_bytes(const std::vector<float>& values) {
  std::string out(4 * values.size(), '\0');
  std::memcpy(out.data(), values.data(), out.size());
  return out;
}

}  // namespace lily::test
