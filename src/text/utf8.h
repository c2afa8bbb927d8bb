// UTF-8 helpers for the tokenizer (docs/model.md §5): lossy validation with U+FFFD, the
// incomplete tail of a byte string, NFC normalisation (utf8proc) and the GPT-2 byte-level
// alphabet that maps every byte to one printable code point.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace lily::utf8 {

/// Length of the well-formed UTF-8 sequence starting at s[0] (1..4), or 0 if s does not start
/// with a complete well-formed sequence (Unicode Table 3-7 byte ranges).
size_t valid_sequence_length(std::string_view s);

/// True iff `s` is well-formed UTF-8.
bool is_valid(std::string_view s);

/// Converts bytes to well-formed UTF-8, replacing each maximal ill-formed subpart by U+FFFD
/// (Unicode §3.9 "substitution of maximal subparts", as Rust's from_utf8_lossy and the WHATWG
/// decoder used by Node's Buffer.toString do).
std::string to_valid_lossy(std::string_view s);

/// Number of trailing bytes of `s` that form a proper prefix of a well-formed sequence (could
/// still be completed by more bytes); 0 if the string ends on a boundary or an invalid byte.
size_t incomplete_tail_length(std::string_view s);

/// Appends the UTF-8 encoding of code point `cp` (must be a Unicode scalar value).
void append_code_point(std::string& out, uint32_t cp);

/// Unicode NFC of well-formed UTF-8 `s` (utf8proc). Returns `s` unchanged when every code point
/// is below U+0300 (such text is always in NFC). Throws lily::Error if utf8proc fails.
std::string nfc(std::string_view s);

/// The GPT-2 byte-level alphabet: byte b ↦ code point (printable bytes map to themselves,
/// the other 68 to U+0100 + k in byte order). Source: the byte-level BPE convention of GPT-2.
const std::array<uint32_t, 256>& byte_to_code_point();

/// Maps every byte of `bytes` through byte_to_code_point() and returns the UTF-8 string.
std::string bytes_to_byte_level(std::string_view bytes);

/// Inverse of bytes_to_byte_level for one token string: if every code point of `token` is in
/// the byte-level alphabet, returns the bytes; otherwise returns `token` unchanged (what the
/// Hugging Face ByteLevel decoder does with tokens outside the alphabet).
std::string byte_level_to_bytes(std::string_view token);

}  // namespace lily::utf8
