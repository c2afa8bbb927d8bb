// UTF-8 checks for the fuzz targets' invariants, independent of src/text (utf8proc directly).
#pragma once
#include <cstdlib>
#include <cstring>
#include <string_view>

#include <utf8proc.h>

namespace lily::fuzz {

/// True when `s` is well-formed UTF-8 (utf8proc's decoder; rejects surrogates and overlongs).
inline bool utf8_well_formed(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    utf8proc_int32_t cp = 0;
    const utf8proc_ssize_t n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                                                static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
    if (n <= 0 || cp < 0) return false;
    i += static_cast<size_t>(n);
  }
  return true;
}

/// True when `s` is well-formed UTF-8 already in NFC (the tokenizer's normalizer); false for
/// ill-formed input (utf8proc_map refuses it).
inline bool utf8_is_nfc(std::string_view s) {
  utf8proc_uint8_t* out = nullptr;
  const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                          static_cast<utf8proc_ssize_t>(s.size()), &out,
                                          static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  const bool same = n >= 0 && static_cast<size_t>(n) == s.size() && std::memcmp(out, s.data(), s.size()) == 0;
  std::free(out);
  return same;
}

}  // namespace lily::fuzz
