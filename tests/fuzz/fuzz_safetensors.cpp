// libFuzzer target: the safetensors header parser and validator (src/io/safetensors.h) on
// arbitrary bytes. The input is the whole file; it is written to an in-memory file (memfd) and
// opened through /proc/self/fd/N, so the real mmap path is exercised without disk I/O.
// Allowed: lily::CheckpointError. Checked on success: every tensor's byte range lies in the
// file, nbytes = numel · dtype_size (and numel() does not overflow), names are unique.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "base/error.h"
#include "fuzz_support.h"
#include "io/safetensors.h"

namespace {

/// One memfd reused across inputs; returns its /proc path after replacing its contents.
std::string write_memfd(const uint8_t* data, size_t size) {
  static int fd = memfd_create("fuzz_safetensors", MFD_CLOEXEC);
  if (fd < 0) lily::fuzz::fail("memfd_create failed");
  if (ftruncate(fd, 0) != 0) lily::fuzz::fail("ftruncate failed");
  size_t done = 0;
  while (done < size) {
    ssize_t n = pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    if (n <= 0) lily::fuzz::fail("pwrite failed");
    done += static_cast<size_t>(n);
  }
  return "/proc/self/fd/" + std::to_string(fd);
}

void check_invariants(const lily::SafetensorsFile& file, uint64_t size) {
  for (const lily::TensorInfo& t : file.tensors()) {
    FUZZ_ASSERT(file.find(t.name) == &t, t.name);
    // numel · element size without overflow (dims are validated as non-negative int64).
    unsigned __int128 bytes = lily::dtype_size(t.dtype);
    bool zero = false;
    for (int64_t d : t.shape) {
      FUZZ_ASSERT(d >= 0, t.name);
      if (d == 0) zero = true;
    }
    if (!zero)
      for (int64_t d : t.shape) {
        bytes *= static_cast<uint64_t>(d);
        FUZZ_ASSERT(bytes <= size, t.name + " claims more bytes than the file has");
      }
    FUZZ_ASSERT((zero ? 0 : static_cast<uint64_t>(bytes)) == t.nbytes, t.name);
    FUZZ_ASSERT(t.nbytes <= size, t.name);
    FUZZ_ASSERT(t.nbytes == 0 || t.data != nullptr, t.name);
    // numel() must be exact for every accepted tensor (callers size buffers with it).
    FUZZ_ASSERT(static_cast<uint64_t>(t.numel()) * lily::dtype_size(t.dtype) == t.nbytes, t.name);
    if (t.nbytes > 0) {
      // Touch the first and last byte: ASan reports a read outside the mapping or copy.
      volatile std::byte first = t.data[0], last = t.data[t.nbytes - 1];
      (void)first;
      (void)last;
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path = write_memfd(data, size);
  try {
    lily::SafetensorsFile file(path);
    FUZZ_ASSERT(file.file_size() == size, "");
    check_invariants(file, size);
  } catch (const lily::CheckpointError&) {
    // Rejected with a message: the expected outcome for most inputs.
  } catch (const std::exception& e) {
    lily::fuzz::unexpected_exception(e);
  }
  return 0;
}
