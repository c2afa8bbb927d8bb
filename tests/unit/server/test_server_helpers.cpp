// Pure helpers of the server: --max-seq rules, model name, key comparison, --bind parsing,
// routes, the log line, response JSON and the Prometheus text.
#include <gtest/gtest.h>

#include "base/error.h"
#include "engine/option_error.h"
#include "server/http_server.h"
#include "server/metrics.h"
#include "server/openai_json.h"

using namespace lily;
using namespace lily::server;

namespace {

/// Expects every one of `parts` somewhere in `text` (a failure names the part).
void expect_contains_all(const std::string& text, std::initializer_list<const char*> parts) {
  for (const char* part : parts) EXPECT_NE(text.find(part), std::string::npos) << part;
}

}  // namespace

TEST(MaxSeq, DefaultsToTheCheckpointAndClamps) {
  EXPECT_EQ(resolve_max_seq(std::nullopt, 4096), 4096);
  EXPECT_EQ(resolve_max_seq(1024, 4096), 1024);
  EXPECT_EQ(resolve_max_seq(8192, 4096), 4096);
  EXPECT_EQ(resolve_max_seq(std::nullopt, 0), kMaxContext);
  EXPECT_EQ(resolve_max_seq(std::nullopt, 1000000), kMaxContext);
  EXPECT_THROW(resolve_max_seq(kMaxContext + 1, 0), Error);
  EXPECT_THROW(resolve_max_seq(1, 4096), Error);
  EXPECT_THROW(resolve_max_seq(0, 4096), Error);
  // A backend with a shorter limit: the default is clamped to it, a request beyond it refused.
  EXPECT_EQ(resolve_max_seq(std::nullopt, 0, 4096), 4096);
  EXPECT_EQ(resolve_max_seq(std::nullopt, 8192, 4096), 4096);
  EXPECT_EQ(resolve_max_seq(2048, 8192, 4096), 2048);
  // The refusals name the option by its field, never as the command line's flag.
  try {
    resolve_max_seq(5000, 8192, 4096);
    FAIL() << "expected OptionError";
  } catch (const OptionError& e) {
    EXPECT_EQ(e.field(), "max_seq");
    EXPECT_STREQ(e.what(), "max_seq 5000 exceeds the backend's limit of 4096 tokens");
    EXPECT_EQ(e.message_naming("--max-seq"), "--max-seq 5000 exceeds the backend's limit of 4096 tokens");
  }
  try {
    resolve_max_seq(1, 4096);
    FAIL() << "expected OptionError";
  } catch (const OptionError& e) {
    EXPECT_EQ(e.field(), "max_seq");
    EXPECT_STREQ(e.what(), "max_seq must be at least 2 (got 1)");
  }
}

TEST(ServerOptionsCheck, NamesTheFieldOutOfRange) {
  EXPECT_NO_THROW(check_server_options(ServerOptions{}));
  struct Bad {
    void (*set)(ServerOptions&);
    const char* message;  ///< the whole what(): the field, then the detail
  };
  const Bad bad[] = {
      {[](ServerOptions& o) { o.max_body = 0; }, "max_body must be at least 1 byte, got 0"},
      {[](ServerOptions& o) { o.max_connections = 0; }, "max_connections must be at least 1, got 0"},
      {[](ServerOptions& o) { o.max_header_bytes = 255; }, "max_header_bytes must be between 256 and 2^24, got 255"},
      {[](ServerOptions& o) { o.max_header_bytes = (1 << 24) + 1; },
       "max_header_bytes must be between 256 and 2^24, got 16777217"},
      {[](ServerOptions& o) { o.max_headers = 0; }, "max_headers must be at least 1, got 0"},
      {[](ServerOptions& o) { o.read_timeout_s = 0; }, "read_timeout_s must be at least 1 s, got 0"},
      {[](ServerOptions& o) { o.write_timeout_s = -1; }, "write_timeout_s must be at least 1 s, got -1"},
      {[](ServerOptions& o) { o.keep_alive_s = 0; }, "keep_alive_s must be at least 1 s, got 0"},
      {[](ServerOptions& o) { o.send_buffer = -1; }, "send_buffer must be between 0 and 2^30 bytes, got -1"},
      // Against the chosen backend's limit, before anything starts.
      {[](ServerOptions& o) { o.backend = BackendKind::kCpu, o.max_batch = 65; },
       "max_batch 65 is outside [1, 64]: the cpu backend runs at most 64 sequences per step"},
      {[](ServerOptions& o) { o.backend = BackendKind::kCuda, o.cuda.max_batch = 16, o.max_batch = 17; },
       "max_batch 17 is outside [1, 16]: the cuda backend runs at most 16 sequences per step"},
      {[](ServerOptions& o) { o.max_batch = -1; },
       "max_batch -1 is outside [1, 64]: the backends this build may pick run at most 64 sequences per step"},
  };
  for (const Bad& b : bad) {
    ServerOptions o;
    b.set(o);
    try {
      check_server_options(o);
      ADD_FAILURE() << "accepted: " << b.message;
    } catch (const OptionError& e) {
      EXPECT_STREQ(e.what(), b.message);
      EXPECT_EQ(std::string(b.message).rfind(e.field() + " ", 0), 0u) << e.field();
    }
  }
}

TEST(ModelName, OverrideThenShapeThenDirectory) {
  ModelConfig c;
  EXPECT_EQ(served_model_name(c, "/x/models/demo", "mine"), "mine");
  EXPECT_EQ(served_model_name(c, "/x/models/demo", ""), "demo");
  EXPECT_EQ(served_model_name(c, "/x/models/demo/", ""), "demo");
}

TEST(ApiKey, ConstantTimeEqual) {
  EXPECT_TRUE(constant_time_equal("secret", "secret"));
  EXPECT_FALSE(constant_time_equal("secret", "secreT"));
  EXPECT_FALSE(constant_time_equal("secret", "secret2"));
  EXPECT_FALSE(constant_time_equal("", "x"));
  EXPECT_TRUE(constant_time_equal("", ""));
}

TEST(Bind, HostPortForms) {
  std::string host;
  int port = 1;
  parse_bind("127.0.0.1:8000", host, port);
  EXPECT_EQ(host, "127.0.0.1");
  EXPECT_EQ(port, 8000);
  parse_bind("[::1]:9000", host, port);
  EXPECT_EQ(host, "::1");
  EXPECT_EQ(port, 9000);
  parse_bind("0.0.0.0", host, port);
  EXPECT_EQ(host, "0.0.0.0");
  EXPECT_EQ(port, 9000);
  // Each refusal is an OptionError for "bind" that quotes the text and says what is wrong.
  const std::pair<const char*, const char*> bad[] = {
      {"host:99999", "bind 'host:99999': port above 65535"},  {"host:12a", "bind 'host:12a': bad port"},
      {":80", "bind ':80': empty host"},              {"[::1", "bind '[::1': missing ']'"},
      {"[::1]80", "bind '[::1]80': expected ':' after ']'"}, {"host:65536", "bind 'host:65536': port above 65535"},
  };
  for (const auto& [text, message] : bad) {
    try {
      parse_bind(text, host, port);
      ADD_FAILURE() << "accepted " << text;
    } catch (const OptionError& e) {
      EXPECT_EQ(e.field(), "bind");
      EXPECT_STREQ(e.what(), message);
    }
  }
}

TEST(Bind, Loopback) {
  EXPECT_TRUE(is_loopback_host("127.0.0.1"));
  EXPECT_TRUE(is_loopback_host("::1"));
  EXPECT_TRUE(is_loopback_host("localhost"));
  EXPECT_FALSE(is_loopback_host("0.0.0.0"));
  EXPECT_FALSE(is_loopback_host("::"));
  // IPv4-mapped loopback, as "[::ffff:127.0.0.1]:P" in --bind leaves it.
  std::string host;
  int port = 0;
  parse_bind("[::ffff:127.0.0.1]:8000", host, port);
  EXPECT_TRUE(is_loopback_host(host));
  EXPECT_TRUE(is_loopback_host("::FFFF:127.1.2.3"));
  EXPECT_TRUE(is_loopback_host("0:0:0:0:0:0:0:1"));
  EXPECT_TRUE(is_loopback_host("127.255.0.1"));
  EXPECT_FALSE(is_loopback_host("::ffff:10.0.0.1"));
  EXPECT_FALSE(is_loopback_host("127.example.com"));  // a name, not an address
  EXPECT_FALSE(is_loopback_host("::2"));
}

TEST(Routes, AllowedMethods) {
  EXPECT_EQ(allowed_methods("/v1/chat/completions"), "POST");
  EXPECT_EQ(allowed_methods("/health"), "GET, HEAD");
  EXPECT_EQ(allowed_methods("/v1/models"), "GET, HEAD");
  EXPECT_EQ(allowed_methods("/metrics"), "GET, HEAD");
  EXPECT_EQ(allowed_methods("/v1/completions"), "POST");
  EXPECT_EQ(allowed_methods("/tokenize"), "POST");
  EXPECT_EQ(allowed_methods("/detokenize"), "POST");
  EXPECT_EQ(allowed_methods("/version"), "GET, HEAD");
  EXPECT_FALSE(allowed_methods("/v1/tokenize").has_value());
  EXPECT_FALSE(allowed_methods("/health/").has_value());
  EXPECT_EQ(allowed_methods("/v1/models/demo"), "GET, HEAD");
  EXPECT_EQ(allowed_methods("/v1/models/org/name"), "GET, HEAD");
  EXPECT_FALSE(allowed_methods("/v1/models/").has_value());
}

TEST(Routes, MethodAllowedIsAnExactMatch) {
  EXPECT_TRUE(method_allowed("GET, HEAD", "GET"));
  EXPECT_TRUE(method_allowed("GET, HEAD", "HEAD"));
  EXPECT_TRUE(method_allowed("POST", "POST"));
  for (const char* method : {"GE", "E", ""}) EXPECT_FALSE(method_allowed("GET, HEAD", method)) << method;
  EXPECT_FALSE(method_allowed("POST", "post"));  // methods are case-sensitive (RFC 9110 §9.1)
}

TEST(Routes, MetricsLabelsAreBounded) {
  EXPECT_EQ(route_label("/v1/chat/completions"), "/v1/chat/completions");
  EXPECT_EQ(route_label("/v1/models"), "/v1/models");
  EXPECT_EQ(route_label("/v1/models/demo"), "/v1/models/{id}");
  EXPECT_EQ(route_label("/v1/models/anything-a-client-sends"), "/v1/models/{id}");
  EXPECT_EQ(route_label("/v1/models/"), "other");
  EXPECT_EQ(route_label("/admin"), "other");
}

TEST(LogLine, TokensAndErrors) {
  EXPECT_EQ(request_log_line("POST", "/v1/chat/completions", 200, 5560, LogTokens{27, 5, 160, 28.77}, ""),
            "POST /v1/chat/completions 200 5560ms prompt=27 cached=5 completion=160 tok/s=28.8");
  EXPECT_EQ(request_log_line("POST", "/v1/chat/completions", 400, 3, std::nullopt, "bad \"request\""),
            "POST /v1/chat/completions 400 3ms error=\"bad \\\"request\\\"\"");
  EXPECT_EQ(request_log_line("GET", "/v1/models", 200, 1, std::nullopt, "", "req_0123"), "GET /v1/models 200 1ms id=req_0123");
  EXPECT_EQ(request_log_line("POST", "/tokenize", 400, 0, std::nullopt, "no", "abc"),
            "POST /tokenize 400 0ms error=\"no\" id=abc");
}

// The error of a log line is a JSON string: a NUL or a newline from a request field (the model
// name) can neither cut the line nor start a forged one.
TEST(LogLine, ErrorsEscapeNulAndControlCharacters) {
  const std::string error = std::string("the model 'a") + '\0' + "b\nlily: info: forged' does not exist";
  EXPECT_EQ(request_log_line("POST", "/v1/chat/completions", 404, 0, std::nullopt, error, "r1"),
            "POST /v1/chat/completions 404 0ms error=\"the model 'a\\u0000b\\nlily: info: forged' does not exist\" "
            "id=r1");
}

TEST(OpenAiJson, TextCompletionShapes) {
  const CompletionMeta meta{"cmpl-1", 7, "demo", "lily-x"};
  const auto whole = text_completion_json(meta, "hi", "stop", Usage{3, 2, 1});
  EXPECT_EQ(whole.dump(),
            R"({"id":"cmpl-1","object":"text_completion","created":7,"model":"demo","system_fingerprint":"lily-x",)"
            R"("choices":[{"text":"hi","index":0,"logprobs":null,"finish_reason":"stop"}],)"
            R"("usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5,"prompt_tokens_details":{"cached_tokens":1}}})");
  const auto chunk = text_chunk_json(meta, "a", std::nullopt, true);
  EXPECT_EQ(chunk["object"], "text_completion");
  EXPECT_EQ(chunk["choices"][0]["text"], "a");
  EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(chunk.contains("usage") && chunk["usage"].is_null());
  const auto last = text_chunk_json(meta, "", std::string("length"), false);
  EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
  EXPECT_FALSE(last.contains("usage"));
  const auto usage = usage_chunk_json(meta, Usage{1, 1, 0}, "text_completion");
  EXPECT_EQ(usage["object"], "text_completion");
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["total_tokens"], 2);
}

TEST(ProcStat, ParsesFieldsAfterTheCommandName) {
  // A command name with spaces and parentheses must not shift the fields.
  const std::string line =
      "4242 (lily (a) b) S 1 4242 4242 0 -1 4194560 500 0 0 0 250 50 0 0 20 0 7 0 12345 123456789 2000 "
      "18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0";
  ProcessStats p;
  ASSERT_TRUE(parse_proc_stat(line, 100.0, 4096, p));
  EXPECT_DOUBLE_EQ(p.cpu_seconds, 3.0);  // (250 + 50) ticks / 100
  EXPECT_EQ(p.threads, 7);
  EXPECT_EQ(p.virtual_bytes, 123456789);
  EXPECT_EQ(p.resident_bytes, 2000 * 4096);
  EXPECT_FALSE(parse_proc_stat("4242 (x) S 1 2", 100.0, 4096, p));
  EXPECT_FALSE(parse_proc_stat("no parenthesis", 100.0, 4096, p));
}

TEST(ProcStat, ReadsThisProcess) {
  const ProcessStats p = read_process_stats();
  EXPECT_GT(p.resident_bytes, 0);
  EXPECT_GE(p.threads, 1);
  EXPECT_GE(p.open_fds, 3);  // stdin, stdout, stderr
  EXPECT_GE(p.max_fds, p.open_fds);
}

TEST(MetricsText, LabelValuesAreEscaped) {
  EXPECT_EQ(escape_label_value("plain 1.0"), "plain 1.0");
  EXPECT_EQ(escape_label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
}

TEST(MetricsText, LatencyProcessAndBuildFamilies) {
  Metrics m;
  m.observe_request_duration(0.2);
  m.observe_queue_time(0.003);
  m.observe_running_time(0.15);
  const std::string text = m.render(EngineGauges{});
  expect_contains_all(text, {
      "# TYPE lily_request_duration_seconds histogram\n",
      "lily_request_duration_seconds_bucket{le=\"0.25\"} 1\n",
      "lily_request_duration_seconds_bucket{le=\"0.1\"} 0\n",
      "lily_request_queue_seconds_bucket{le=\"0.005\"} 1\n",
      "lily_request_running_seconds_count 1\n",
      "# TYPE process_resident_memory_bytes gauge\n",
      "# TYPE process_open_fds gauge\n",
      "# TYPE process_threads gauge\n",
      "# TYPE process_cpu_seconds_total counter\n",
      "lily_build_info{version=\"",
      "\"} 1\n"});
}

TEST(OpenAiJson, CompletionShape) {
  CompletionMeta meta{"chatcmpl-1", 42, "demo", "lily-abc"};
  auto doc = completion_json(meta, "hello", "stop", Usage{10, 3, 4});
  EXPECT_EQ(dump(doc),
            R"({"id":"chatcmpl-1","object":"chat.completion","created":42,"model":"demo","system_fingerprint":"lily-abc",)"
            R"("choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"logprobs":null,"finish_reason":"stop"}],)"
            R"("usage":{"prompt_tokens":10,"completion_tokens":3,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":4}}})");
}

TEST(OpenAiJson, ChunksAndUsageChunk) {
  CompletionMeta meta{"c", 1, "m", "f"};
  auto chunk = chunk_json(meta, {{"content", "x"}}, std::nullopt, true);
  EXPECT_EQ(chunk["object"], "chat.completion.chunk");
  EXPECT_TRUE(chunk["choices"][0]["finish_reason"].is_null());
  EXPECT_TRUE(chunk.contains("usage") && chunk["usage"].is_null());
  EXPECT_FALSE(chunk_json(meta, {{"content", "x"}}, std::nullopt, false).contains("usage"));
  auto last = chunk_json(meta, nlohmann::ordered_json::object(), std::string("length"), false);
  EXPECT_EQ(last["choices"][0]["finish_reason"], "length");
  auto usage = usage_chunk_json(meta, Usage{5, 2, 0});
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["total_tokens"], 7);
  EXPECT_EQ(sse_event("{}"), "data: {}\n\n");
}

TEST(OpenAiJson, InvalidUtf8IsReplacedNotThrown) {
  nlohmann::ordered_json doc{{"content", std::string("a\xff")}};
  EXPECT_EQ(dump(doc), "{\"content\":\"a\xEF\xBF\xBD\"}");
}

TEST(OpenAiJson, Models) {
  EXPECT_EQ(dump(models_json("demo", 7)),
            R"({"object":"list","data":[{"id":"demo","object":"model","created":7,"owned_by":"lily"}]})");
}

TEST(OpenAiJson, OneModel) {
  EXPECT_EQ(dump(model_json("demo", 7)), R"({"id":"demo","object":"model","created":7,"owned_by":"lily"})");
}

TEST(MetricsText, CountersHistogramsAndGauges) {
  Metrics m;
  m.record_request("/health", 200);
  m.record_request("/health", 200);
  m.record_request("/v1/chat/completions", 400);
  m.record_tokens(10, 4, 3);
  m.observe_ttft(0.03);
  m.observe_inter_token(0.002);
  EngineGauges g;
  g.queue_depth = 2;
  g.cache.hits = 5;
  g.cache.misses = 6;
  g.cache.tokens_saved = 77;
  g.cache.device.bytes = 1234;
  g.cache.host.bytes = 4321;
  g.cache.device.evictions = 8;
  g.cache.host.evictions = 3;
  g.cache.host_copies_pending = 2;
  g.cache.kv_shared_snapshots = 5;
  const std::string text = m.render(g);
  expect_contains_all(text, {
      "lily_http_requests_total{route=\"/health\",status=\"200\"} 2\n",
      "lily_http_requests_total{route=\"/v1/chat/completions\",status=\"400\"} 1\n",
      "lily_prompt_tokens_total 10\n",
      "lily_cached_prompt_tokens_total 4\n",
      "lily_completion_tokens_total 3\n",
      "lily_time_to_first_token_seconds_bucket{le=\"0.025\"} 0\n",
      "lily_time_to_first_token_seconds_bucket{le=\"0.05\"} 1\n",
      "lily_time_to_first_token_seconds_count 1\n",
      "lily_inter_token_latency_seconds_bucket{le=\"+Inf\"} 1\n",
      "lily_queue_depth 2\n",
      "lily_cache_hits_total 5\n",
      "lily_cache_misses_total 6\n",
      "lily_cache_tokens_saved_total 77\n",
      "lily_cache_bytes{tier=\"device\"} 1234\n",
      "lily_cache_bytes{tier=\"host\"} 4321\n",
      "lily_cache_evictions_total{tier=\"device\"} 8\n",
      "lily_cache_evictions_total{tier=\"host\"} 3\n",
      "# TYPE lily_cache_snapshots gauge\n",
      "lily_cache_kv_shared_total 5\n",
      "lily_cache_host_copies_pending 2\n"});
}

TEST(Metrics, BatchGaugesAndStepHistograms) {
  Metrics m;
  m.observe_step(3, 0.004);
  m.observe_step(8, 0.02);
  EngineGauges g;
  g.queue_depth = 4;
  g.running = 8;
  g.batch_size = 8;
  g.max_batch = 8;
  const std::string text = m.render(g);
  expect_contains_all(text, {"lily_requests_waiting 4\n", "lily_requests_running 8\n", "lily_batch_size 8\n",
                             "lily_max_batch 8\n", "lily_step_seconds_bucket{le=\"0.005\"} 1\n",
                             "lily_step_seconds_count 2\n", "lily_step_batch_size_bucket{le=\"4\"} 1\n",
                             "lily_step_batch_size_bucket{le=\"8\"} 2\n", "lily_step_batch_size_sum 11\n",
                             "# TYPE lily_step_seconds histogram\n",
                             "# HELP lily_max_batch Most requests one engine step holds.\n",
                             "# HELP lily_http_connections_evicted_total Idle connections (waiting for a request head) "
                             "closed to admit a new one at the connection limit.\n"});
  // The help texts are the server's own words: no command-line flag (e.g. --max-batch).
  EXPECT_EQ(text.find("--"), std::string::npos) << text;
}

TEST(Metrics, RequestPhasesAddUpPerPhase) {
  Metrics m;
  RequestPhases a;
  a.parse = 0.001;
  a.tokenize = 0.25;
  a.cache_lookup = 0.5;
  a.cache_store = 2;
  RequestPhases b;
  b.parse = 0.002;
  b.snapshot = 0.125;
  b.prefill = 1.5;
  m.record_phases(a);
  m.record_phases(b);
  const std::string text = m.render(EngineGauges{});
  expect_contains_all(text, {
      "# TYPE lily_request_phase_seconds_total counter\n",
      "lily_request_phase_seconds_total{phase=\"parse\"} 0.003\n",
      "lily_request_phase_seconds_total{phase=\"template\"} 0\n",
      "lily_request_phase_seconds_total{phase=\"tokenize\"} 0.25\n",
      "lily_request_phase_seconds_total{phase=\"queue\"} 0\n",
      "lily_request_phase_seconds_total{phase=\"cache_lookup\"} 0.5\n",
      "lily_request_phase_seconds_total{phase=\"new_state\"} 0\n",
      "lily_request_phase_seconds_total{phase=\"snapshot\"} 0.125\n",
      "lily_request_phase_seconds_total{phase=\"prefill\"} 1.5\n",
      "lily_request_phase_seconds_total{phase=\"decode\"} 0\n",
      "lily_request_phase_seconds_total{phase=\"cache_store\"} 2\n"});
  // In the order a request goes through them.
  EXPECT_LT(text.find("{phase=\"parse\"}"), text.find("{phase=\"tokenize\"}"));
  EXPECT_LT(text.find("{phase=\"prefill\"}"), text.find("{phase=\"cache_store\"}"));
}
