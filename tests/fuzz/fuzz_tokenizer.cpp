// libFuzzer target: the byte-level BPE tokenizer of the demo model (models/demo/tokenizer.json,
// src/text/tokenizer.h) on arbitrary input. The first byte picks the mode:
//   even: the rest is text — encode it with and without special tokens;
//   odd:  the rest is a list of little-endian int32 ids (any value, also negative or past the
//         vocabulary) — decode it and stream it through the IncrementalDecoder.
// Nothing may throw. Invariants checked:
//   - encode without special tokens never yields a special token id (user text stays text);
//   - every encoded id is inside the vocabulary;
//   - for well-formed NFC text, decode(encode(text)) == text (round trip, both modes);
//   - the concatenated IncrementalDecoder output (pushes + flush) equals decode(ids), for both
//     skip_special settings (streamed and non-streamed answers must agree);
//   - every output of decode/push/flush is well-formed UTF-8.
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_support.h"
#include "fuzz_utf8.h"
#include "text/tokenizer.h"

namespace {

using lily::fuzz::utf8_is_nfc;
using lily::fuzz::utf8_well_formed;

void check_encode(const lily::Tokenizer& tok, std::string_view text) {
  const bool round_trips = utf8_well_formed(text) && utf8_is_nfc(text);
  for (bool allow_special : {false, true}) {
    const std::vector<int32_t> ids = tok.encode(text, allow_special);
    for (int32_t id : ids) {
      FUZZ_ASSERT(id >= 0 && id < tok.vocab_size(), std::to_string(id));
      if (!allow_special)
        FUZZ_ASSERT(!tok.is_special(id), "special id " + std::to_string(id) + " from plain text '" +
                                             lily::fuzz::printable(text) + "'");
    }
    FUZZ_ASSERT(text.empty() == ids.empty(), lily::fuzz::printable(text));
    const std::string back = tok.decode(ids, /*skip_special=*/false);
    FUZZ_ASSERT(utf8_well_formed(back), lily::fuzz::printable(back));
    if (round_trips)
      FUZZ_ASSERT(back == text, "'" + lily::fuzz::printable(text) + "' decoded as '" + lily::fuzz::printable(back) + "'");
  }
}

void check_decode(const std::shared_ptr<const lily::Tokenizer>& tok, const std::vector<int32_t>& ids) {
  for (bool skip_special : {true, false}) {
    const std::string whole = tok->decode(ids, skip_special);
    FUZZ_ASSERT(utf8_well_formed(whole), lily::fuzz::printable(whole));
    lily::IncrementalDecoder stream(tok, skip_special);
    std::string streamed;
    for (int32_t id : ids) {
      std::string piece = stream.push(id);
      FUZZ_ASSERT(utf8_well_formed(piece), lily::fuzz::printable(piece));
      streamed += piece;
    }
    std::string rest = stream.flush();
    FUZZ_ASSERT(utf8_well_formed(rest), lily::fuzz::printable(rest));
    streamed += rest;
    FUZZ_ASSERT(streamed == whole, "streamed '" + lily::fuzz::printable(streamed) + "' vs decoded '" +
                                       lily::fuzz::printable(whole) + "'");
    FUZZ_ASSERT(stream.flush().empty(), "flush does not reset");
  }
  for (int32_t id : ids) (void)tok->token_bytes(id), (void)tok->is_special(id);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const auto& tok = lily::fuzz::demo_tokenizer();
  const uint8_t mode = data[0];
  ++data;
  --size;
  try {
    if (mode % 2 == 0) {
      check_encode(*tok, std::string_view(reinterpret_cast<const char*>(data), size));
    } else {
      std::vector<int32_t> ids(size / 4);
      if (!ids.empty()) std::memcpy(ids.data(), data, ids.size() * 4);
      // Half the time fold ids into the vocabulary so that decoding is mostly real tokens.
      if (mode & 2)
        for (int32_t& id : ids) id = static_cast<int32_t>(static_cast<uint32_t>(id) % static_cast<uint32_t>(tok->vocab_size()));
      check_decode(tok, ids);
    }
  } catch (const std::exception& e) {
    lily::fuzz::unexpected_exception(e);
  }
  return 0;
}
