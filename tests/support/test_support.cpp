#include "support/test_support.h"

#include <sys/wait.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "model/config_json.h"
#include "model/synth.h"

namespace lily::test {

std::filesystem::path source_dir() { return LILY_SOURCE_DIR; }
std::filesystem::path binary_dir() { return LILY_BINARY_DIR; }
std::filesystem::path demo_model_dir() { return source_dir() / "models" / "demo"; }

ModelConfig synth_preset_config(const std::string& name) {
  return parse_model_config(nlohmann::json::parse(synth_preset(name).config.dump()), name);
}

void write_file(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

void copy_dir(const std::filesystem::path& from, const std::filesystem::path& to) {
  std::filesystem::create_directories(to);
  for (const auto& e : std::filesystem::directory_iterator(from))
    if (e.is_regular_file())
      std::filesystem::copy_file(e.path(), to / e.path().filename(),
                                 std::filesystem::copy_options::overwrite_existing);
}

std::filesystem::path copy_demo_model(const TempDir& tmp) {
  const std::filesystem::path dir = tmp.path() / "m";
  std::filesystem::copy(demo_model_dir(), dir, std::filesystem::copy_options::recursive);
  return dir;
}

int mappings_of(const std::filesystem::path& file) {
  const std::string name = file.string();
  std::ifstream maps("/proc/self/maps");
  int n = 0;
  for (std::string line; std::getline(maps, line);)
    if (line.size() >= name.size() && line.compare(line.size() - name.size(), std::string::npos, name) == 0) ++n;
  return n;
}

namespace {

CliRun run_command(const std::string& cmd) {
  CliRun r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.output.append(buf.data(), n);
  const int status = ::pclose(p);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

}  // namespace

CliRun run_lily(const std::string& args, bool merge_stderr) {
  return run_command((binary_dir() / "lily").string() + " " + args + (merge_stderr ? " 2>&1" : " 2>/dev/null"));
}

CliRun run_lily_bounded(const std::string& args, bool merge_stderr, int seconds) {
  return run_command("timeout -k 5 " + std::to_string(seconds) + " " + (binary_dir() / "lily").string() + " " + args +
                     (merge_stderr ? " 2>&1" : " 2>/dev/null"));
}

CliRun run_lily_stdout_to(const std::string& args, const std::string& stdout_path, int seconds) {
  // stderr to the pipe first, then stdout to the file.
  return run_command("timeout -k 5 " + std::to_string(seconds) + " " + (binary_dir() / "lily").string() + " " + args +
                     " 2>&1 >'" + stdout_path + "'");
}

TempDir::TempDir() {
  std::random_device rd;
  for (int attempt = 0; attempt < 100; ++attempt) {
    auto candidate = std::filesystem::temp_directory_path() /
                     ("lily-test-" + std::to_string(rd()) + std::to_string(attempt));
    if (std::filesystem::create_directory(candidate)) {
      path_ = candidate;
      return;
    }
  }
  throw std::runtime_error("could not create a temporary directory");
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

double cosine_similarity(std::span<const float> a, std::span<const float> b) {
  if (a.size() != b.size()) throw std::invalid_argument("cosine_similarity: length mismatch");
  double dot = 0, na = 0, nb = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    dot += double(a[i]) * b[i];
    na += double(a[i]) * a[i];
    nb += double(b[i]) * b[i];
  }
  return dot / (std::sqrt(na) * std::sqrt(nb) + 1e-30);
}

}  // namespace lily::test
