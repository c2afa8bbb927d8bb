// `lily tokenize` — look at the tokenizer and chat template of a checkpoint
// (docs/model.md §5–6):
// (--model defaults to the repository's models/demo, as for serve, generate and bench)
//   lily tokenize --model DIR [--json] [--special] TEXT      ids of TEXT ("1,2,3" or {"ids":[…]})
//   lily tokenize --model DIR --decode 1,2,3 [--keep-special] the text of ids
//   lily tokenize --model DIR --render-messages JSON [--json] the chat prompt (text, or text+ids),
//                                                            rendered with the checkpoint's template
//   lily tokenize --tokenizer FILE --batch-jsonl FILE|-       one JSON request per line (tests);
//                      with --tokenizer, prompts use lily's built-in template
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "base/error.h"
#include "cli/commands.h"
#include "cli/model_paths.h"
#include "text/chat_template.h"
#include "text/tokenizer.h"

namespace lily::cli {
namespace {

using json = nlohmann::json;

struct TokenizeOptions {
  std::string model_dir;
  std::string tokenizer_file;
  std::string text;
  std::string decode_ids;
  std::string messages_json;
  std::string chat_options;  ///< --chat-options JSON (tools, thinking) for --render-messages
  std::string batch_file;
  bool text_given = false;  ///< the TEXT argument was on the command line (even if empty)
  bool json_output = false;
  bool special = false;
  bool keep_special = false;
};

/// The checkpoint's chat template with --model (or the default model), the built-in one with
/// --tokenizer.
std::shared_ptr<const ChatTemplate> load_chat_template(const TokenizeOptions& o) {
  if (!o.tokenizer_file.empty()) return ChatTemplate::builtin();
  return ChatTemplate::for_model(model_dir_or_default(o.model_dir));
}

std::shared_ptr<const Tokenizer> load_tokenizer(const TokenizeOptions& o) {
  if (!o.tokenizer_file.empty()) return Tokenizer::from_file(o.tokenizer_file);
  return Tokenizer::from_file(model_dir_or_default(o.model_dir) / "tokenizer.json");
}

/// "1,2,3" → ids, each in [0, vocab); throws lily::Error naming the item at fault.
std::vector<int32_t> parse_id_list(const std::string& list, int32_t vocab) {
  std::vector<int32_t> ids;
  std::stringstream in(list);
  std::string item;
  while (std::getline(in, item, ',')) {
    try {
      size_t used = 0;
      long long v = std::stoll(item, &used);
      if (used != item.size() || v < 0 || v > INT32_MAX) throw std::invalid_argument(item);
      ids.push_back(static_cast<int32_t>(v));
    } catch (const std::logic_error&) {
      throw Error("--decode: '" + item + "' is not a token id (expected e.g. 1,2,3)");
    }
    if (ids.back() >= vocab)
      throw Error("--decode: token id " + item + " is outside the vocabulary (ids 0.." + std::to_string(vocab - 1) +
                  ")");
  }
  if (ids.empty()) throw Error("--decode: no token ids given (expected e.g. 1,2,3)");
  return ids;
}

std::vector<int32_t> ids_of(const json& list) {
  if (!list.is_array()) throw Error("expected an array of token ids");
  std::vector<int32_t> ids;
  for (const json& v : list) {
    if (!v.is_number_integer()) throw Error("token ids must be integers");
    ids.push_back(v.get<int32_t>());
  }
  return ids;
}

std::string bytes_of_hex(const std::string& hex) {
  if (hex.size() % 2 != 0) throw Error("encode_hex needs an even number of hex digits");
  std::string bytes;
  for (size_t i = 0; i < hex.size(); i += 2) bytes.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return bytes;
}

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// One batch request (see the file comment of tests/node/tokenizer.test.mjs for the protocol).
json run_request(const std::shared_ptr<const Tokenizer>& tok, const ChatTemplate& chat, const json& req) {
  bool skip = req.value("skip_special", true);
  if (req.contains("encode")) return {{"ids", tok->encode(req["encode"].get<std::string>(), req.value("special", false))}};
  if (req.contains("encode_hex"))
    return {{"ids", tok->encode(bytes_of_hex(req["encode_hex"].get<std::string>()), req.value("special", false))}};
  if (req.contains("decode")) {
    std::vector<int32_t> ids = ids_of(req["decode"]);
    return {{"text", tok->decode(ids, skip)}};
  }
  if (req.contains("incremental")) {
    IncrementalDecoder dec(tok, skip);
    json pieces = json::array();
    for (int32_t id : ids_of(req["incremental"])) pieces.push_back(dec.push(id));
    pieces.push_back(dec.flush());
    return {{"pieces", pieces}};
  }
  if (req.contains("render")) {
    std::vector<ChatMessage> messages = parse_message_list(req["render"], "render");
    return {{"text", chat.render(messages)}, {"ids", chat.encode(*tok, messages)}};
  }
  throw Error("unknown request: expected encode, encode_hex, decode, incremental or render");
}

void run_batch(const TokenizeOptions& o) {
  auto tok = load_tokenizer(o);
  const auto chat = load_chat_template(o);
  std::ifstream file;
  if (o.batch_file != "-") {
    std::error_code ec;
    if (std::filesystem::is_directory(o.batch_file, ec)) throw Error("--batch-jsonl " + o.batch_file + " is a directory");
    file.open(o.batch_file, std::ios::binary);
    if (!file) throw Error("cannot open " + o.batch_file);
  }
  std::istream& in = o.batch_file == "-" ? std::cin : file;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    json reply;
    try {
      json request = parse_json_flag(line, "--batch-jsonl");
      if (request.is_discarded()) throw Error("--batch-jsonl: not valid JSON");
      reply = run_request(tok, *chat, request);
    } catch (const std::exception& e) {  // lily::Error or a malformed JSON line
      reply = {{"error", e.what()}};
    }
    std::cout << dump(reply) << '\n';
  }
}

void run_single(const TokenizeOptions& o) {
  const int modes = o.text_given + !o.decode_ids.empty() + !o.messages_json.empty();
  if (modes == 0)
    throw Error("lily tokenize: nothing to do: give TEXT to encode, --decode IDS, --render-messages JSON or "
                "--batch-jsonl FILE");
  if (modes > 1) throw Error("lily tokenize: give only one of TEXT, --decode and --render-messages");
  auto tok = load_tokenizer(o);
  if (!o.decode_ids.empty()) {
    std::string text = tok->decode(parse_id_list(o.decode_ids, tok->vocab_size()), !o.keep_special);
    std::cout << (o.json_output ? dump({{"text", text}}) : text) << '\n';
  } else if (!o.messages_json.empty()) {
    json parsed = parse_json_flag(o.messages_json, "--render-messages");
    if (parsed.is_discarded()) throw Error("--render-messages: not valid JSON");
    std::vector<ChatMessage> messages = parse_message_list(parsed, "--render-messages");
    const auto chat = load_chat_template(o);
    const ChatTemplateOptions options = parse_chat_options(o.chat_options, "--chat-options");
    std::string text = chat->render(messages, options);
    if (o.json_output) {
      std::cout << dump({{"text", text}, {"ids", chat->encode(*tok, messages, options)}}) << '\n';
    } else {
      std::cout << text;
    }
  } else {
    std::vector<int32_t> ids = tok->encode(o.text, o.special);
    if (o.json_output) {
      std::cout << dump({{"ids", ids}}) << '\n';
    } else {
      for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? "," : "") << ids[i];
      std::cout << '\n';
    }
  }
}

}  // namespace

void register_tokenize(CLI::App& app, int& exit_code) {
  auto opts = std::make_shared<TokenizeOptions>();
  auto* cmd = app.add_subcommand("tokenize", "Encode text, decode ids or render a chat prompt with a checkpoint's tokenizer");
  cmd->add_option("--model", opts->model_dir,
                  "checkpoint directory (reads DIR/tokenizer.json; default: the repository's models/demo)");
  cmd->add_option("--tokenizer", opts->tokenizer_file, "a tokenizer.json file instead of --model");
  auto* text = cmd->add_option("text", opts->text, "text to encode");
  cmd->add_option("--decode", opts->decode_ids, "comma-separated ids to decode, e.g. 1,2,3");
  cmd->add_option("--render-messages", opts->messages_json,
                  "JSON array of {role, content} messages: print the chat prompt (thinking disabled)");
  cmd->add_option("--chat-options", opts->chat_options, "with --render-messages: JSON object of a chat request's "
                  "tools, tool_choice, reasoning_effort and chat_template_kwargs, passed to the chat template");
  cmd->add_option("--batch-jsonl", opts->batch_file, "read one JSON request per line from FILE ('-': stdin)");
  cmd->add_flag("--json", opts->json_output, "print JSON");
  cmd->add_flag("--special", opts->special, "match added-token strings (e.g. <|im_start|>) as their ids");
  cmd->add_flag("--keep-special", opts->keep_special, "with --decode: keep special tokens in the text");
  cmd->callback([opts, text, &exit_code] {
    opts->text_given = text->count() > 0;
    if (opts->batch_file.empty()) {
      run_single(*opts);
    } else {
      run_batch(*opts);
    }
    exit_code = 0;
  });
}

}  // namespace lily::cli
