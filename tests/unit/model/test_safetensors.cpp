// The safetensors reader and the checkpoint directory (docs/model.md §2.1) on hand-built files:
// every malformed header is rejected with a message naming the file and the tensor.
#include <gtest/gtest.h>

#include <cstring>

#include "base/error.h"
#include "io/checkpoint.h"
#include "io/safetensors.h"
#include "support/safetensors_builder.h"
#include "support/test_support.h"

namespace lily {
namespace {

using test::SafetensorsBuilder;
using test::TempDir;
using test::write_file;

/// Bytes of a safetensors file whose header is exactly `header_text`, followed by `data`.
std::string raw_file(const std::string& header_text, const std::string& data, uint64_t declared_len = ~0ull) {
  uint64_t n = declared_len == ~0ull ? header_text.size() : declared_len;
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header_text + data;
}

/// Opening `bytes` as a safetensors file throws CheckpointError whose message contains all `parts`.
void expect_rejected(const std::string& bytes, std::initializer_list<std::string> parts) {
  TempDir dir;
  const auto path = dir.path() / "model.safetensors";
  write_file(path, bytes);
  try {
    SafetensorsFile file(path);
    FAIL() << "accepted a bad file; expected an error mentioning " << *parts.begin();
  } catch (const CheckpointError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << msg;
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
  }
}

SafetensorsBuilder two_tensors() {
  SafetensorsBuilder b;
  b.add("a.weight", "F32", {2, 3}, test::f32_bytes({1, 2, 3, 4, 5, 6}));
  b.add("b.scales", "BF16", {4}, test::bf16_bytes(4, 0.5f));
  return b;
}

TEST(Safetensors, ReadsAWellFormedFile) {
  TempDir dir;
  two_tensors().write(dir.path() / "x.safetensors");
  SafetensorsFile file(dir.path() / "x.safetensors");
  ASSERT_EQ(file.tensors().size(), 2u);
  const TensorInfo* a = file.find("a.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dtype, DType::kF32);
  EXPECT_EQ(a->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a->nbytes, 24u);
  float v[6];
  std::memcpy(v, a->data, 24);
  EXPECT_EQ(v[5], 6.0f);
  EXPECT_EQ(file.find("__metadata__"), nullptr);
  EXPECT_EQ(file.find("nope"), nullptr);
  EXPECT_EQ(file.find("b.scales")->dtype, DType::kBF16);
}

TEST(Safetensors, AcceptsEveryKnownDtype) {
  const char* names[] = {"BF16", "F16", "F32", "F64", "U8", "I8", "U16", "I16",
                         "U32", "I32", "U64", "I64", "BOOL", "F8_E4M3", "F8_E5M2"};
  SafetensorsBuilder b;
  for (const char* n : names) {
    auto dt = parse_dtype(n);
    ASSERT_TRUE(dt.has_value()) << n;
    EXPECT_STREQ(dtype_name(*dt), n);
    b.add(std::string("t_") + n, n, {3}, std::string(3 * dtype_size(*dt), '\0'));
  }
  TempDir dir;
  b.write(dir.path() / "x.safetensors");
  SafetensorsFile file(dir.path() / "x.safetensors");
  EXPECT_EQ(file.tensors().size(), std::size(names));
  EXPECT_EQ(file.find("t_F8_E4M3")->dtype, DType::kF8E4M3);
}

TEST(Safetensors, RejectsHeaderLengthPastTheEnd) {
  auto b = two_tensors();
  std::string bytes = b.serialize();
  expect_rejected(raw_file(b.header().dump(), "", 1u << 20), {"header length", "past the end"});
  expect_rejected(raw_file("{}", "", ~0ull - 1), {"header length"});
  (void)bytes;
}

TEST(Safetensors, RejectsTooShortFile) { expect_rejected(std::string("\x02\0\0", 3), {"too short"}); }

TEST(Safetensors, RejectsInvalidJson) {
  expect_rejected(raw_file("{\"a\": {\"dtype\": \"F32\",", ""), {"not valid UTF-8 JSON"});
  expect_rejected(raw_file("[1, 2]", ""), {"not a JSON object"});
}

TEST(Safetensors, RejectsInvalidUtf8InHeader) {
  expect_rejected(raw_file("{\"a\xff\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [0, 0]}}", ""),
                  {"UTF-8"});
}

TEST(Safetensors, RejectsUnknownDtype) {
  auto b = two_tensors();
  auto h = b.header();
  h["b.scales"]["dtype"] = "Q4_K";
  expect_rejected(b.serialize(h), {"b.scales", "unknown dtype Q4_K"});
}

TEST(Safetensors, RejectsShapeBytesMismatch) {
  auto b = two_tensors();
  auto h = b.header();
  h["a.weight"]["shape"] = {2, 4};
  expect_rejected(b.serialize(h), {"a.weight", "[2, 4]", "32 bytes", "cover 24"});
}

TEST(Safetensors, RejectsNegativeOrNonIntegerDims) {
  auto b = two_tensors();
  auto h = b.header();
  h["a.weight"]["shape"] = {-2, -3};
  expect_rejected(b.serialize(h), {"a.weight", "negative"});
  h["a.weight"]["shape"] = {2.5, 3};
  expect_rejected(b.serialize(h), {"a.weight"});
}

TEST(Safetensors, RejectsOverflowingShape) {
  auto b = two_tensors();
  auto h = b.header();
  h["a.weight"]["shape"] = {int64_t(1) << 40, int64_t(1) << 40};
  expect_rejected(b.serialize(h), {"a.weight", "2^64"});
}

TEST(Safetensors, RejectsOutOfRangeOffsets) {
  auto b = two_tensors();
  auto h = b.header();
  h["b.scales"]["data_offsets"] = {24, 24 + 8 + 1000};
  h["b.scales"]["shape"] = {504};
  expect_rejected(b.serialize(h), {"b.scales", "past the data section"});
  h = b.header();
  h["b.scales"]["data_offsets"] = {32, 24};
  expect_rejected(b.serialize(h), {"b.scales", "end before start"});
}

TEST(Safetensors, RejectsOverlappingRanges) {
  auto b = two_tensors();
  auto h = b.header();
  h["b.scales"]["data_offsets"] = {20, 28};  // a.weight covers [0, 24)
  expect_rejected(b.serialize(h), {"b.scales", "overlaps", "a.weight"});
}

TEST(Safetensors, RejectsDuplicateNames) {
  std::string header =
      "{\"x\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0, 1]},"
      " \"x\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [1, 2]}}";
  expect_rejected(raw_file(header, "ab"), {"x", "twice"});
}

TEST(Safetensors, RejectsTruncatedFile) {
  std::string bytes = two_tensors().serialize();
  bytes.resize(bytes.size() - 5);  // cut into b.scales
  expect_rejected(bytes, {"b.scales", "truncated"});
}

TEST(Safetensors, RejectsGgufByMagic) {
  std::string gguf = "GGUF";
  gguf += std::string("\x03\0\0\0", 4) + std::string(64, '\0');
  expect_rejected(gguf, {"GGUF"});
  TempDir dir;
  write_file(dir.path() / "m.gguf", gguf);
  EXPECT_TRUE(is_gguf_file(dir.path() / "m.gguf"));
  write_file(dir.path() / "not.gguf", "GGML....");
  EXPECT_FALSE(is_gguf_file(dir.path() / "not.gguf"));
}

TEST(Safetensors, ZeroSizedTensorsDoNotOverlap) {
  SafetensorsBuilder b;
  b.add("empty", "F32", {0, 4}, "");
  b.add("x", "U8", {2}, "ab");
  TempDir dir;
  b.write(dir.path() / "x.safetensors");
  SafetensorsFile file(dir.path() / "x.safetensors");
  EXPECT_EQ(file.find("empty")->nbytes, 0u);
  // A zero after dimensions whose product overflows is still an empty tensor, not "2^64 bytes".
  auto h = b.header();
  h["empty"]["shape"] = {int64_t(1) << 62, 4, 0};
  write_file(dir.path() / "y.safetensors", b.serialize(h));
  EXPECT_EQ(SafetensorsFile(dir.path() / "y.safetensors").find("empty")->nbytes, 0u);
}

TEST(Safetensors, MisalignedDataGetsAnAlignedCopy) {
  // Header of odd length: the U32 tensor lands at an address that is not 4-byte aligned.
  SafetensorsBuilder b;
  b.add("w", "U32", {2}, std::string("\x01\0\0\0\x02\0\0\0", 8));
  std::string header = b.header().dump() + " ";
  if ((8 + header.size()) % 4 == 0) header += " ";
  TempDir dir;
  write_file(dir.path() / "x.safetensors", raw_file(header, std::string("\x01\0\0\0\x02\0\0\0", 8)));
  SafetensorsFile file(dir.path() / "x.safetensors");
  const TensorInfo* w = file.find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(w->data) % 4, 0u);
  EXPECT_EQ(reinterpret_cast<const uint32_t*>(w->data)[1], 2u);
}

// --- checkpoint directories ---------------------------------------------------------------

void write_index(const std::filesystem::path& dir, const nlohmann::json& weight_map) {
  write_file(dir / "model.safetensors.index.json", nlohmann::json{{"metadata", {}}, {"weight_map", weight_map}}.dump());
}

void expect_checkpoint_rejected(const std::filesystem::path& dir, std::initializer_list<std::string> parts) {
  try {
    Checkpoint ckpt(dir);
    FAIL() << "accepted a bad checkpoint directory";
  } catch (const CheckpointError& e) {
    for (const auto& p : parts) EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
  }
}

struct Shards {
  TempDir dir;
  Shards() {
    SafetensorsBuilder a, b;
    a.add("t1", "F32", {2}, test::f32_bytes({1, 2}));
    a.add("t2", "F32", {1}, test::f32_bytes({3}));
    b.add("t3", "BF16", {2}, test::bf16_bytes(2, 1.0f));
    a.write(dir.path() / "model-00001-of-00002.safetensors");
    b.write(dir.path() / "model-00002-of-00002.safetensors");
  }
  nlohmann::json map() const {
    return {{"t1", "model-00001-of-00002.safetensors"},
            {"t2", "model-00001-of-00002.safetensors"},
            {"t3", "model-00002-of-00002.safetensors"}};
  }
};

TEST(Checkpoint, OpensShardedIndex) {
  Shards s;
  write_index(s.dir.path(), s.map());
  Checkpoint ckpt(s.dir.path());
  EXPECT_TRUE(ckpt.sharded());
  EXPECT_EQ(ckpt.tensor_count(), 3u);
  EXPECT_EQ(ckpt.files().size(), 2u);
  EXPECT_EQ(ckpt.get("t3").dtype, DType::kBF16);
  EXPECT_EQ(ckpt.get("t3").file, "model-00002-of-00002.safetensors");
  EXPECT_EQ(ckpt.find("t4"), nullptr);
  EXPECT_THROW(ckpt.get("t4"), CheckpointError);
  EXPECT_EQ(ckpt.tensors().front()->name, "t1");
  EXPECT_GT(ckpt.bytes_on_disk(), 0u);
}

/// Writes the two-shard checkpoint's index after `edit` changed its weight map, and expects the
/// checkpoint to be refused with a message holding every needle.
template <typename Edit>
void expect_index_rejected(Edit edit, std::initializer_list<std::string> needles) {
  Shards s;
  auto m = s.map();
  edit(m);
  write_index(s.dir.path(), m);
  expect_checkpoint_rejected(s.dir.path(), needles);
}

TEST(Checkpoint, RejectsMissingShard) {
  expect_index_rejected([](auto& m) { m["t3"] = "model-00003-of-00002.safetensors"; },
                        {"model-00003-of-00002.safetensors", "does not exist"});
}

TEST(Checkpoint, RejectsTensorInTwoShards) {
  Shards s;
  SafetensorsBuilder b;
  b.add("t3", "BF16", {2}, test::bf16_bytes(2, 1.0f));
  b.add("t1", "F32", {2}, test::f32_bytes({1, 2}));
  b.write(s.dir.path() / "model-00002-of-00002.safetensors");
  write_index(s.dir.path(), s.map());
  expect_checkpoint_rejected(s.dir.path(), {"t1", "two shards"});
}

TEST(Checkpoint, RejectsTensorListedButAbsent) {
  expect_index_rejected([](auto& m) { m["t9"] = "model-00002-of-00002.safetensors"; }, {"t9", "does not contain"});
}

TEST(Checkpoint, RejectsTensorPresentButNotListed) {
  expect_index_rejected([](auto& m) { m.erase("t2"); }, {"t2", "not listed"});
}

TEST(Checkpoint, RejectsShardPathOutsideTheDirectory) {
  Shards s;
  auto m = s.map();
  m["t3"] = "../elsewhere.safetensors";
  write_index(s.dir.path(), m);
  expect_checkpoint_rejected(s.dir.path(), {"not a plain file name"});
  // A NUL would cut the name short at open(2): the shard named is not the one opened.
  m = s.map();
  m["t3"] = std::string("model-00002-of-00002.safetensors") + '\0' + "x";
  write_index(s.dir.path(), m);
  expect_checkpoint_rejected(s.dir.path(), {"not a plain file name"});
}

TEST(Checkpoint, RejectsBadIndexJson) {
  Shards s;
  write_file(s.dir.path() / "model.safetensors.index.json", "{\"weight_map\": ");
  expect_checkpoint_rejected(s.dir.path(), {"model.safetensors.index.json", "JSON"});
  write_file(s.dir.path() / "model.safetensors.index.json", "{\"metadata\": {}}");
  expect_checkpoint_rejected(s.dir.path(), {"weight_map"});
}

TEST(Checkpoint, SingleFile) {
  TempDir dir;
  two_tensors().write(dir.path() / "model.safetensors");
  Checkpoint ckpt(dir.path());
  EXPECT_FALSE(ckpt.sharded());
  EXPECT_EQ(ckpt.tensor_count(), 2u);
}

TEST(Checkpoint, NeitherFileNamesWhatIsThere) {
  TempDir dir;
  expect_checkpoint_rejected(dir.path(), {"no model.safetensors.index.json or model.safetensors"});
  write_file(dir.path() / "pytorch_model.bin", "x");
  expect_checkpoint_rejected(dir.path(), {"pytorch_model.bin", "not supported"});
  write_file(dir.path() / "qwen-q4_k_m.gguf", "GGUF");
  expect_checkpoint_rejected(dir.path(), {"qwen-q4_k_m.gguf", "GGUF"});
  expect_checkpoint_rejected(dir.path() / "missing", {"not a directory"});
}

}  // namespace
}  // namespace lily
