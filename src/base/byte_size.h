// Byte counts as people write them ("512MiB", "4G", "1073741824") and as logs print them, and
// the host's memory as the kernel reports it.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace lily {

/// Parses a byte count: a non-negative integer or decimal number, optionally followed by a unit
/// K, M, G or T (each with an optional "i" and "B": "4G", "4GiB" and "4GB" all mean 4 × 1024³,
/// powers of 1024 as for memory sizes) or "B". Case-insensitive; no spaces. nullopt for anything
/// else, or for a value above 2⁶³ − 1 bytes.
std::optional<int64_t> parse_byte_size(std::string_view text);

/// "512 B", "1.5 KiB", "63.2 MiB", "4.00 GiB" (powers of 1024).
std::string format_bytes(int64_t bytes);

/// The host's memory in bytes: `total` (MemTotal) and `available` (MemAvailable: what can be
/// allocated without swapping), from /proc/meminfo; both 0 when it cannot be read.
struct HostMemory {
  int64_t total = 0;
  int64_t available = 0;
};
HostMemory read_host_memory();

}  // namespace lily
