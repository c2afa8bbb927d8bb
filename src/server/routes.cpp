// LilyServer's routing: the gate every request passes (404, 405, API key), CORS preflights,
// the 500 for an unexpected exception, and the endpoints that answer at once without
// generating: /health, /v1/models, /metrics, /version, /tokenize and /detokenize. The
// generating endpoints are in generation.cpp.
#include "server/server_impl.h"

#include <algorithm>
#include <cctype>

#include "base/build_info.h"
#include "base/log.h"

namespace lily::server::detail {

void LilyServer::handle(Exchange& ex, const Request& req) {
  Reply res;
  try {
    route(ex, req, res);
  } catch (const ApiError& e) {
    send_error(res, e);
  } catch (...) {
    on_exception(res, std::current_exception());
  }
  if (!ex.started()) ex.send(res);
}

std::optional<ApiError> LilyServer::gate(std::string_view method_sv, std::string_view path_sv,
                                         const http::fields& head) const {
  const std::string method(method_sv), path(path_sv);
  const auto allowed = allowed_methods(path);
  if (!allowed)
    return ApiError(404, "invalid_request_error", "unknown route: " + method + " " + path, std::nullopt, "not_found");
  if (method == "OPTIONS") return std::nullopt;  // answered before the key: a preflight carries none
  if (!method_allowed(*allowed, method))
    return ApiError(405, "invalid_request_error",
                    "method " + method + " is not allowed on " + path + " (allowed: " + *allowed + ")", std::nullopt,
                    "method_not_allowed")
        .with_header("Allow", *allowed);
  if (!options_.api_key.empty() && (path != "/health" || options_.health_requires_key)) {
    const std::string auth(head[http::field::authorization]);
    // The scheme is case-insensitive (RFC 9110 §11.1): "bearer KEY" is as good as "Bearer KEY".
    const std::string prefix = "bearer ";
    bool scheme_ok = auth.size() > prefix.size();
    for (size_t i = 0; scheme_ok && i < prefix.size(); ++i)
      scheme_ok = std::tolower(static_cast<unsigned char>(auth[i])) == prefix[i];
    const bool ok = scheme_ok && constant_time_equal(std::string_view(auth).substr(prefix.size()), options_.api_key);
    if (!ok)
      return ApiError(401, "invalid_request_error",
                      auth.empty() ? "missing API key: send 'Authorization: Bearer <key>'" : "invalid API key",
                      std::nullopt, "invalid_api_key")
          .with_header("WWW-Authenticate", "Bearer");
  }
  return std::nullopt;
}

void LilyServer::route(Exchange& ex, const Request& req, Reply& res) {
  if (auto e = gate(ex.method, ex.path, req)) return send_error(res, *e);
  if (ex.method == "OPTIONS") return handle_options(ex, req, res);
  // Range and conditional headers are not looked at: every answer is whole (200, never 206).
  if (ex.path == "/health") return handle_health(res);
  if (ex.path == "/v1/models") return handle_models(res);
  if (ex.path == "/metrics") return handle_metrics(res);
  if (ex.path == "/version") return handle_version(res);
  if (ex.path == "/v1/chat/completions") return handle_chat(ex, req, res);
  if (ex.path == "/v1/completions") return handle_completion(ex, req, res);
  if (ex.path == "/tokenize") return handle_tokenize(req, res);
  if (ex.path == "/detokenize") return handle_detokenize(req, res);
  // Clients percent-encode the id ("Qwen%2FQwen3" for "Qwen/Qwen3"); a malformed escape is
  // compared as sent (and so not found).
  const std::string raw = ex.path.substr(std::string_view("/v1/models/").size());
  handle_model(percent_decode(raw).value_or(raw), res);
}

void LilyServer::handle_options(Exchange& ex, const Request& req, Reply& res) {
  const std::string allowed = *allowed_methods(ex.path) + ", OPTIONS";
  res.status = 204;
  res.content_type.clear();
  res.headers.emplace_back("Allow", allowed);
  // A preflight (Origin + Access-Control-Request-Method) from an allowed origin; any other
  // origin gets no CORS headers, which the browser takes as a refusal.
  if (req.count(http::field::access_control_request_method) == 0 ||
      !cors_allow_origin(options_.allowed_origins, req[http::field::origin]))
    return;
  res.headers.emplace_back("Access-Control-Allow-Methods", allowed);
  res.headers.emplace_back("Access-Control-Allow-Headers",
                           cors_allow_headers(req[http::field::access_control_request_headers]));
  res.headers.emplace_back("Access-Control-Max-Age", "600");
}

void LilyServer::on_exception(Reply& res, std::exception_ptr ep) {
  const std::string id = t_request.id;
  try {
    if (ep) std::rethrow_exception(ep);
  } catch (const std::exception& e) {
    log_error("request failed (" + id + "): " + e.what());
  } catch (...) {
    log_error("request failed (" + id + "): unknown exception");
  }
  res.headers.clear();
  send_error(res, ApiError(500, "server_error", "internal server error (request id " + id + ")"));
}

void LilyServer::handle_health(Reply& res) {
  if (shutting_down_) return set_json(res, 503, R"({"status":"shutting_down"})");
  if (!ready_) {
    res.headers.emplace_back("Retry-After", "1");
    return set_json(res, 503, R"({"status":"loading"})");
  }
  set_json(res, 200, R"({"status":"ok"})");
}

void LilyServer::handle_models(Reply& res) { set_json(res, 200, dump(models_json(model_name_, created_))); }

void LilyServer::handle_model(const std::string& id, Reply& res) {
  if (id != model_name_)
    return send_error(res, ApiError(404, "invalid_request_error",
                                    "the model '" + id + "' does not exist; this server serves '" + model_name_ + "'",
                                    "model", "model_not_found"));
  set_json(res, 200, dump(model_json(model_name_, created_)));
}

void LilyServer::handle_metrics(Reply& res) {
  EngineGauges g;
  g.ready = ready_;
  if (ready_) {
    g.queue_depth = scheduler_->queue_depth();
    g.running = scheduler_->running();
    g.batch_size = scheduler_->batch_size();
    g.max_batch = scheduler_->max_batch();
    g.cache = scheduler_->cache_stats();
  }
  res.status = 200;
  res.content_type = "text/plain; version=0.0.4; charset=utf-8";
  res.body = metrics_.render(g);
}

void LilyServer::handle_tokenize(const Request& req, Reply& res) {
  const TokenizeRequest request = parse_tokenize_request(req.body());
  if (request.model) check_model(*request.model);
  check_ready();
  std::vector<int32_t> ids;
  if (request.prompt) {
    // This tokenizer adds no BOS/EOS, so add_special_tokens changes nothing.
    ids = tokenizer_->encode(*request.prompt, /*allow_special=*/true);
  } else {
    try {
      ChatTemplateOptions options = template_options(request.agent, options_.reasoning, request.add_generation_prompt);
      options.continue_final_message = request.continue_final_message;
      ids = chat_template_->encode(*tokenizer_, request.messages, options);
    } catch (const Error& e) {
      throw invalid_request(std::string("messages cannot be rendered with the chat template: ") + e.what(),
                            "messages");
    }
  }
  ordered_json doc{{"count", ids.size()}, {"max_model_len", max_seq_}, {"tokens", ids}};
  set_json(res, 200, dump(doc));
}

void LilyServer::handle_detokenize(const Request& req, Reply& res) {
  const DetokenizeRequest request = parse_detokenize_request(req.body());
  if (request.model) check_model(*request.model);
  check_ready();
  const std::vector<int32_t> ids = checked_ids(request.tokens, "tokens");
  set_json(res, 200, dump(ordered_json{{"prompt", tokenizer_->decode(ids, /*skip_special=*/false)}}));
}

void LilyServer::handle_version(Reply& res) {
  set_json(res, 200,
           dump(ordered_json{{"version", build_version()},
                             {"commit", build_commit()},
                             {"build_type", build_type()},
                             {"compiler", build_compiler()},
                             {"cuda", build_has_cuda()}}));
}

}  // namespace lily::server::detail
