// DeviceBuffer: an owning, move-only span of device memory (cudaMalloc / cudaFree). The CUDA
// backend's weights and scratch are held in these, allocated at load, never inside the decode
// loop; sequence states take theirs from a block pool instead (cuda_backend.cpp, CudaState).
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <utility>

#include "backends/cuda/cuda_check.h"

namespace lily::cuda {

/// Owning device allocation of `bytes` bytes (uninitialised). Move-only; frees on destruction.
/// Throws lily::Error naming the size when cudaMalloc fails.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) { allocate(bytes); }
  ~DeviceBuffer() { release(); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(std::exchange(o.ptr_, nullptr)), bytes_(std::exchange(o.bytes_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      release();
      ptr_ = std::exchange(o.ptr_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
    }
    return *this;
  }

  /// Raw pointer cast to T (no check of alignment beyond cudaMalloc's 256 B).
  template <class T>
  T* as() const { return static_cast<T*>(ptr_); }
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  bool empty() const { return ptr_ == nullptr; }

  /// Fills the buffer with byte `value` and waits for the device, so that work on any stream
  /// (also a non-blocking one, which is not ordered after the legacy stream cudaMemset uses)
  /// sees the bytes. For set-up, not for hot paths.
  void fill_bytes(int value) {
    if (!ptr_) return;
    CUDA_CHECK(cudaMemset(ptr_, value, bytes_));
    CUDA_CHECK(cudaDeviceSynchronize());
  }

 private:
  void allocate(size_t bytes) {
    if (bytes == 0) return;
    cudaError_t st = cudaMalloc(&ptr_, bytes);
    if (st != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky-free error state
      ptr_ = nullptr;
      throw ::lily::Error("CUDA: cannot allocate " + std::to_string(bytes) + " bytes of device memory (" +
                          cudaGetErrorString(st) + ")");
    }
    bytes_ = bytes;
  }
  void release() noexcept {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

/// Copies `count` elements host -> device (synchronous).
template <class T>
void upload(T* device_dst, const T* host_src, size_t count) {
  CUDA_CHECK(cudaMemcpy(device_dst, host_src, count * sizeof(T), cudaMemcpyHostToDevice));
}
/// Copies `count` elements device -> host (synchronous).
template <class T>
void download(T* host_dst, const T* device_src, size_t count) {
  CUDA_CHECK(cudaMemcpy(host_dst, device_src, count * sizeof(T), cudaMemcpyDeviceToHost));
}

}  // namespace lily::cuda
