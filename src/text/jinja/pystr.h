// Python str semantics on UTF-8 byte strings for the chat-template engine: code-point length,
// indexing and slicing, whitespace (str.isspace), strip/split/replace/upper/lower. Invalid
// UTF-8 bytes count as one code point each and are never changed.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lily::jinja::pystr {

/// Byte offsets of each code point's start, plus s.size() at the end.
std::vector<size_t> code_point_offsets(std::string_view s);
/// Number of code points.
size_t length(std::string_view s);
/// Python str.isspace for one code point.
bool is_space(uint32_t cp);
/// Byte range [first, second) that str.strip/lstrip/rstrip keeps; `chars` nullopt = whitespace,
/// else the set of code points in it.
std::pair<size_t, size_t> strip_range(std::string_view s, const std::optional<std::string>& chars, bool left,
                                      bool right);
/// str.strip/lstrip/rstrip (the text of strip_range).
std::string strip(std::string_view s, const std::optional<std::string>& chars, bool left, bool right);
/// Byte ranges of the parts of str.split(sep, maxsplit); nullopt sep = runs of whitespace.
/// Throws lily::Error on an empty sep.
std::vector<std::pair<size_t, size_t>> split_ranges(std::string_view s, const std::optional<std::string>& sep,
                                                    int64_t maxsplit);
/// str.split (the texts of split_ranges).
std::vector<std::string> split(std::string_view s, const std::optional<std::string>& sep, int64_t maxsplit);
/// str.replace(old, new, count); count < 0 = all.
std::string replace(std::string_view s, std::string_view old, std::string_view repl, int64_t count);
/// str.upper / str.lower (simple case mapping per code point).
std::string upper(std::string_view s);
std::string lower(std::string_view s);
/// str.capitalize / str.title (simple case mapping).
std::string capitalize(std::string_view s);
std::string title(std::string_view s);

}  // namespace lily::jinja::pystr
