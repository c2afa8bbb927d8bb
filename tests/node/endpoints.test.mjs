// Black-box tests of the endpoints and HTTP features on the demo model: the legacy
// POST /v1/completions (OpenAI client), POST /tokenize and /detokenize (vLLM's shapes) against
// the Hugging Face tokenizer and chat template, GET /version, CORS (--allowed-origins), request
// ids, the new /metrics series, and the small HTTP findings (505, Date, absolute-form targets,
// Expect, --port abc).
// Each suite shares one server (serverForSuite).
// Run: LILY_BIN=build/lily node --test tests/node/endpoints.test.mjs
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import net from 'node:net';
import path from 'node:path';
import OpenAI from 'openai';
import { Template } from '@huggingface/jinja';
import { Tokenizer } from 'tokenizers';
import {
  LILY_BIN, MODEL, MODEL_DIR, SOURCE_DIR, metrics, parseSse, rawRequest, serverForSuite,
} from './server_harness.mjs';

const KEY = 'endpoints-test-key';
const ORIGIN = 'http://app.example:3000';
const golden = JSON.parse(fs.readFileSync(path.join(SOURCE_DIR, 'tests', 'fixtures', 'demo.golden.json'), 'utf8'));
const hf = Tokenizer.fromFile(path.join(MODEL_DIR, 'tokenizer.json'));
const demoTemplate = new Template(fs.readFileSync(path.join(MODEL_DIR, 'chat_template.jinja'), 'utf8'));
const hfIds = async (text) => (await hf.encode(text, null, { addSpecialTokens: false })).getIds();

const auth = { Authorization: `Bearer ${KEY}` };

/** POST with a JSON body and the API key; parses the JSON answer. */
async function post(server, route, body, headers = {}) {
  const payload = typeof body === 'string' ? body : JSON.stringify(body);
  const res = await rawRequest(server, 'POST', route, {
    body: payload,
    headers: { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(payload), ...auth, ...headers },
  });
  let json = null;
  try { json = JSON.parse(res.body); } catch { /* a stream */ }
  return { ...res, json };
}

/** Asserts an OpenAI-shaped error with this status and param. */
function assertError(res, status, param, code) {
  assert.equal(res.status, status, res.body);
  assert.deepEqual(Object.keys(res.json.error), ['message', 'type', 'param', 'code']);
  assert.equal(res.json.error.param, param, res.body);
  if (code) assert.equal(res.json.error.code, code, res.body);
}

/** Writes `text` on a fresh socket and resolves with everything the server sent until it closed. */
function rawExchange(server, text, { timeoutMs = 5000, endAfterWrite = false } = {}) {
  const u = new URL(server.url);
  return new Promise((resolve, reject) => {
    const sock = net.connect({ port: Number(u.port), host: u.hostname });
    const parts = [];
    const timer = setTimeout(() => { sock.destroy(); resolve(Buffer.concat(parts).toString('latin1')); }, timeoutMs);
    sock.on('connect', () => { sock.write(text); if (endAfterWrite) sock.end(); });
    sock.on('data', (c) => parts.push(c));
    sock.on('close', () => { clearTimeout(timer); resolve(Buffer.concat(parts).toString('latin1')); });
    sock.on('error', (e) => { clearTimeout(timer); reject(e); });
  });
}

describe('completions, tokenize, version, CORS and API keys (--api-key, --allowed-origins)', () => {
  const suite = serverForSuite(['--api-key', KEY, '--allowed-origins', `${ORIGIN}, http://other.example`], { apiKey: KEY });

  it('POST /v1/completions with token ids reproduces the chat golden (same engine path)', async () => {
    const g = golden.goldens[0];
    const res = await suite.openai.completions.create({ model: MODEL, prompt: g.prompt_ids, max_tokens: 64 });
    assert.match(res.id, /^cmpl-/);
    assert.equal(res.object, 'text_completion');
    assert.equal(res.model, MODEL);
    assert.match(res.system_fingerprint, /^lily-/);
    assert.equal(res.choices.length, 1);
    assert.equal(res.choices[0].index, 0);
    assert.equal(res.choices[0].logprobs, null);
    assert.equal(res.choices[0].text, g.text);
    assert.equal(res.choices[0].finish_reason, 'length');
    assert.equal(res.usage.prompt_tokens, g.prompt_ids.length);
    assert.equal(res.usage.completion_tokens, 64);
    assert.equal(res.usage.total_tokens, g.prompt_ids.length + 64);
  });

  it('POST /v1/completions with a text prompt: special-token strings become control tokens', async () => {
    const g = golden.goldens[0];
    // The chat prompt as text (detokenize keeps special tokens) encodes back to the same ids.
    const text = (await post(suite.server, '/detokenize', { tokens: g.prompt_ids })).json.prompt;
    assert.match(text, /^<\|im_start\|>user\n/);
    const res = await suite.openai.completions.create({ model: MODEL, prompt: text, max_tokens: 16 });
    assert.equal(res.usage.prompt_tokens, g.prompt_ids.length);
    assert.equal(res.choices[0].text, (await suite.openai.completions.create({ model: MODEL, prompt: [g.prompt_ids], max_tokens: 16 })).choices[0].text);
    assert.ok(g.text.startsWith(res.choices[0].text), JSON.stringify(res.choices[0].text));
    // A one-element array of text is the same prompt.
    const one = await suite.openai.completions.create({ model: MODEL, prompt: [text], max_tokens: 16 });
    assert.equal(one.choices[0].text, res.choices[0].text);
  });

  it('streams /v1/completions as text_completion chunks ending in [DONE], with usage when asked', async () => {
    const g = golden.goldens[0];
    const stream = await suite.openai.completions.create({
      model: MODEL, prompt: g.prompt_ids, max_tokens: 64, stream: true, stream_options: { include_usage: true },
    });
    const chunks = [];
    for await (const c of stream) chunks.push(c);
    assert.ok(chunks.length > 3);
    for (const c of chunks) {
      assert.equal(c.object, 'text_completion');
      assert.match(c.id, /^cmpl-/);
      assert.equal(c.id, chunks[0].id);
    }
    const text = chunks.map((c) => c.choices[0]?.text ?? '').join('');
    assert.equal(text, g.text);
    const withReason = chunks.filter((c) => c.choices[0]?.finish_reason);
    assert.equal(withReason.length, 1);
    assert.equal(withReason[0].choices[0].finish_reason, 'length');
    const last = chunks.at(-1);
    assert.deepEqual(last.choices, []);
    assert.equal(last.usage.prompt_tokens, g.prompt_ids.length);
    assert.equal(last.usage.completion_tokens, 64);
    // Raw: the wire format ends with data: [DONE] and carries the request id.
    const raw = await post(suite.server, '/v1/completions', { model: MODEL, prompt: 'Hello', max_tokens: 4, stream: true });
    assert.equal(raw.status, 200);
    assert.match(raw.headers['content-type'], /^text\/event-stream/);
    assert.match(raw.headers['x-request-id'], /^req_[0-9a-f]{16}$/);
    assert.ok(parseSse(raw.body).done);
  });

  it('stop strings end a completion and are cut off', async () => {
    const g = golden.goldens[0];
    const stop = g.text.slice(20, 26);
    const res = await suite.openai.completions.create({ model: MODEL, prompt: g.prompt_ids, max_tokens: 64, stop });
    assert.equal(res.choices[0].finish_reason, 'stop');
    assert.equal(res.choices[0].text, g.text.slice(0, g.text.indexOf(stop)));
  });

  it('/v1/completions validates like chat: 400 naming the field, 404 for the model', async () => {
    const base = { model: MODEL, prompt: 'hi', max_tokens: 4 };
    assertError(await post(suite.server, '/v1/completions', { ...base, echo: true, logprobs: 1 }), 400, 'echo', 'unsupported_value');
    assertError(await post(suite.server, '/v1/completions', { ...base, prompt: ['a', 'b'] }), 400, 'prompt', 'unsupported_value');
    assertError(await post(suite.server, '/v1/completions', { ...base, prompt: [1, 999999] }), 400, 'prompt[1]');
    assertError(await post(suite.server, '/v1/completions', { ...base, prompt: [[1, -2]] }), 400, 'prompt[0][1]');
    assertError(await post(suite.server, '/v1/completions', { ...base, prompt: '' }), 400, 'prompt');
    assertError(await post(suite.server, '/v1/completions', { ...base, prompt: 5 }), 400, 'prompt', 'invalid_type');
    assertError(await post(suite.server, '/v1/completions', { model: MODEL }), 400, 'prompt', 'missing_required_parameter');
    assertError(await post(suite.server, '/v1/completions', { ...base, max_tokens: 0 }), 400, 'max_tokens');
    assertError(await post(suite.server, '/v1/completions', { ...base, max_tokens: 100000 }), 400, 'max_tokens', 'context_length_exceeded');
    assertError(await post(suite.server, '/v1/completions', { ...base, temperature: 2.5 }), 400, 'temperature', 'invalid_value');
    assertError(await post(suite.server, '/v1/completions', { ...base, n: 9 }), 400, 'n', 'invalid_value');
    // Sampling fields work as in chat: the same seed gives the same text.
    const s1 = await post(suite.server, '/v1/completions', { ...base, temperature: 1, seed: 7 });
    const s2 = await post(suite.server, '/v1/completions', { ...base, temperature: 1, seed: 7 });
    assert.equal(s1.status, 200, s1.body);
    assert.equal(JSON.parse(s1.body).choices[0].text, JSON.parse(s2.body).choices[0].text);
    assertError(await post(suite.server, '/v1/completions', { ...base, suffix: 'x' }), 400, 'suffix', 'unsupported_parameter');
    assertError(await post(suite.server, '/v1/completions', { ...base, frobnicate: 1 }), 400, 'frobnicate', 'unknown_parameter');
    assertError(await post(suite.server, '/v1/completions', { ...base, model: 'gpt-3.5-turbo-instruct' }), 404, 'model', 'model_not_found');
    assertError(await post(suite.server, '/v1/completions', '{"model":'), 400, null, 'invalid_json');
    // Accepted no-ops of the legacy API.
    const ok = await post(suite.server, '/v1/completions', { ...base, echo: false, best_of: 1, logprobs: null, n: 1, suffix: null });
    assert.equal(ok.status, 200, ok.body);
    await assert.rejects(suite.openai.completions.create({ ...base, echo: true, logprobs: 2 }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'echo');
  });

  it('POST /tokenize matches the Hugging Face tokenizer; /detokenize round-trips', async () => {
    for (const text of ['Hello world', 'CMake target_link_libraries(app PRIVATE lib)', 'naïve café — 東京 🚀', ' two  spaces\n']) {
      const res = await post(suite.server, '/tokenize', { prompt: text });
      assert.equal(res.status, 200, res.body);
      assert.deepEqual(Object.keys(res.json), ['count', 'max_model_len', 'tokens']);
      assert.deepEqual(res.json.tokens, await hfIds(text), text);
      assert.equal(res.json.count, res.json.tokens.length);
      assert.equal(res.json.max_model_len, 4096);
      const back = await post(suite.server, '/detokenize', { tokens: res.json.tokens });
      assert.equal(back.status, 200, back.body);
      assert.deepEqual(back.json, { prompt: text });
    }
    // add_special_tokens is accepted (this tokenizer adds none); special strings are control tokens.
    const special = await post(suite.server, '/tokenize', { prompt: '<|im_start|>user', add_special_tokens: false });
    assert.deepEqual(special.json.tokens, await hfIds('<|im_start|>user'));
    assert.equal(special.json.tokens[0], 8188);
  });

  it('POST /tokenize with messages renders the chat template, with or without the generation prompt', async () => {
    const g = golden.goldens[0];
    const withPrompt = await post(suite.server, '/tokenize', { messages: g.messages });
    assert.equal(withPrompt.status, 200, withPrompt.body);
    assert.deepEqual(withPrompt.json.tokens, g.prompt_ids);
    const conversation = [...g.messages, { role: 'assistant', content: 'It adds an executable target.' }];
    const without = await post(suite.server, '/tokenize', { messages: conversation, add_generation_prompt: false });
    assert.equal(without.status, 200, without.body);
    const rendered = demoTemplate.render({ messages: conversation, add_generation_prompt: false });
    assert.deepEqual(without.json.tokens, await hfIds(rendered));
    const noSuffix = await post(suite.server, '/tokenize', { messages: g.messages, add_generation_prompt: false });
    assert.deepEqual(noSuffix.json.tokens, g.prompt_ids.slice(0, noSuffix.json.count));
    assert.ok(noSuffix.json.count < g.prompt_ids.length);
    assertError(await post(suite.server, '/tokenize', { messages: conversation }), 400, 'messages[1].role');
  });

  it('/tokenize and /detokenize reject bad input with 400 naming the field', async () => {
    assertError(await post(suite.server, '/detokenize', { tokens: [1, 8192] }), 400, 'tokens[1]');
    assertError(await post(suite.server, '/detokenize', { tokens: [1, 2.5] }), 400, 'tokens[1]', 'invalid_type');
    assertError(await post(suite.server, '/detokenize', { tokens: 'abc' }), 400, 'tokens', 'invalid_type');
    assertError(await post(suite.server, '/detokenize', {}), 400, 'tokens', 'missing_required_parameter');
    assertError(await post(suite.server, '/detokenize', { tokens: [1], model: 'other' }), 404, 'model', 'model_not_found');
    assertError(await post(suite.server, '/tokenize', {}), 400, 'prompt', 'missing_required_parameter');
    assertError(await post(suite.server, '/tokenize', { prompt: 'a', messages: [] }), 400, 'messages');
    assertError(await post(suite.server, '/tokenize', { prompt: 7 }), 400, 'prompt', 'invalid_type');
    assertError(await post(suite.server, '/tokenize', { prompt: 'a', add_special_tokens: 'yes' }), 400, 'add_special_tokens');
    assertError(await post(suite.server, '/tokenize', { prompt: 'a', extra: 1 }), 400, 'extra', 'unknown_parameter');
    const named = await post(suite.server, '/tokenize', { prompt: 'a', model: MODEL });
    assert.equal(named.status, 200);
    const get = await rawRequest(suite.server, 'GET', '/tokenize', { headers: auth });
    assert.equal(get.status, 405);
    assert.equal(get.headers.allow, 'POST');
    assert.equal((await rawRequest(suite.server, 'POST', '/tokenize', { body: '{}' })).status, 401);
  });

  it('GET /version answers the build, the same as lily_build_info', async () => {
    const res = await rawRequest(suite.server, 'GET', '/version', { headers: auth });
    assert.equal(res.status, 200);
    const v = JSON.parse(res.body);
    assert.match(v.version, /^\d+\.\d+\.\d+$/);
    assert.equal(typeof v.commit, 'string');
    assert.equal(typeof v.cuda, 'boolean');
    assert.ok(v.build_type.length > 0 && v.compiler.length > 0);
    const m = await metrics(suite.server, auth);
    const info = [...m.keys()].find((k) => k.startsWith('lily_build_info{'));
    assert.ok(info, 'lily_build_info is exported');
    assert.equal(m.get(info), 1);
    assert.ok(info.includes(`version="${v.version}"`) && info.includes(`commit="${v.commit}"`), info);
    assert.equal((await rawRequest(suite.server, 'GET', '/version')).status, 401);
  });

  it('CORS preflight from an allowed origin gets 204 with the allow headers, before the key check', async () => {
    const res = await rawRequest(suite.server, 'OPTIONS', '/v1/chat/completions', {
      headers: {
        Origin: ORIGIN, 'Access-Control-Request-Method': 'POST',
        'Access-Control-Request-Headers': 'authorization, content-type, x-stainless-os',
      },
    });
    assert.equal(res.status, 204);
    assert.equal(res.body, '');
    assert.equal(res.headers['content-length'], undefined);
    assert.equal(res.headers['access-control-allow-origin'], ORIGIN);
    assert.match(res.headers.vary, /Origin/);
    assert.match(res.headers['access-control-allow-methods'], /\bPOST\b/);
    assert.equal(res.headers['access-control-allow-headers'], 'authorization, content-type, x-stainless-os');
    assert.ok(Number(res.headers['access-control-max-age']) > 0);
    // Without requested headers the usual ones are allowed.
    const plain = await rawRequest(suite.server, 'OPTIONS', '/v1/models', {
      headers: { Origin: 'http://other.example', 'Access-Control-Request-Method': 'GET' },
    });
    assert.equal(plain.status, 204);
    assert.equal(plain.headers['access-control-allow-origin'], 'http://other.example');
    assert.match(plain.headers['access-control-allow-headers'], /Authorization/);
    assert.match(plain.headers['access-control-allow-headers'], /Content-Type/);
    assert.match(plain.headers['access-control-allow-methods'], /\bGET\b/);
  });

  it('CORS: a non-matching origin gets no CORS headers; allowed origins see ACAO on every answer', async () => {
    const denied = await rawRequest(suite.server, 'OPTIONS', '/v1/chat/completions', {
      headers: { Origin: 'http://evil.example', 'Access-Control-Request-Method': 'POST' },
    });
    for (const name of Object.keys(denied.headers)) assert.ok(!name.startsWith('access-control-'), name);
    const deniedGet = await rawRequest(suite.server, 'GET', '/v1/models', { headers: { ...auth, Origin: 'http://evil.example' } });
    assert.equal(deniedGet.status, 200);
    for (const name of Object.keys(deniedGet.headers)) assert.ok(!name.startsWith('access-control-'), name);
    const prefix = await rawRequest(suite.server, 'GET', '/v1/models', { headers: { ...auth, Origin: `${ORIGIN}.evil.example` } });
    assert.equal(prefix.headers['access-control-allow-origin'], undefined);
    const ok = await rawRequest(suite.server, 'GET', '/v1/models', { headers: { ...auth, Origin: ORIGIN } });
    assert.equal(ok.headers['access-control-allow-origin'], ORIGIN);
    assert.match(ok.headers['access-control-expose-headers'], /X-Request-Id/i);
    assert.match(ok.headers['access-control-expose-headers'], /Retry-After/i);
    // An error (no key) is readable by the page too.
    const noKey = await rawRequest(suite.server, 'GET', '/v1/models', { headers: { Origin: ORIGIN } });
    assert.equal(noKey.status, 401);
    assert.equal(noKey.headers['access-control-allow-origin'], ORIGIN);
    // A stream, too.
    const stream = await post(suite.server, '/v1/completions', { model: MODEL, prompt: 'Hi', max_tokens: 2, stream: true }, { Origin: ORIGIN });
    assert.equal(stream.headers['access-control-allow-origin'], ORIGIN);
  });

  it('X-Request-Id: a well-formed client id is echoed and logged; others are replaced', async () => {
    const id = 'client-Trace_01.a:b';
    const res = await post(suite.server, '/v1/completions', { model: MODEL, prompt: 'Hi', max_tokens: 2 }, { 'X-Request-Id': id });
    assert.equal(res.status, 200);
    assert.equal(res.headers['x-request-id'], id);
    for (const bad of ['has space', 'x'.repeat(129), 'semi;colon', '']) {
      const r = await rawRequest(suite.server, 'GET', '/v1/models', { headers: { ...auth, 'X-Request-Id': bad } });
      assert.match(r.headers['x-request-id'], /^req_[0-9a-f]{16}$/, bad);
    }
    const long = 'y'.repeat(128);
    assert.equal((await rawRequest(suite.server, 'GET', '/v1/models', { headers: { ...auth, 'X-Request-Id': long } })).headers['x-request-id'], long);
    const a = await rawRequest(suite.server, 'GET', '/nowhere', { headers: auth });
    const b = await rawRequest(suite.server, 'GET', '/nowhere', { headers: auth });
    assert.equal(a.status, 404);
    assert.match(a.headers['x-request-id'], /^req_[0-9a-f]{16}$/);
    assert.notEqual(a.headers['x-request-id'], b.headers['x-request-id']);
    // Errors name it in the log line.
    const bad = await post(suite.server, '/v1/completions', { model: MODEL, prompt: 'Hi', echo: true, logprobs: 1 }, { 'X-Request-Id': 'echo-err-7' });
    assert.equal(bad.headers['x-request-id'], 'echo-err-7');
    await new Promise((r) => setTimeout(r, 50));
    assert.match(suite.server.log, new RegExp(`POST /v1/completions 200 \\d+ms .*id=${id.replace(/\./g, '\\.')}\\n`));
    assert.match(suite.server.log, /POST \/v1\/completions 400 \d+ms error="[^"]*echo[^"]*" id=echo-err-7\n/);
  });

  it('a NUL byte in the model name is kept in the error body and escaped in the log line', async () => {
    // The log line and the message used to stop at the NUL ("the model 'a").
    for (const [route, body] of [
      ['/v1/chat/completions', { model: 'a\u0000b', messages: [{ role: 'user', content: 'hi' }] }],
      ['/v1/completions', { model: 'c\u0000d', prompt: 'Hi' }],
    ]) {
      const id = `nul-${route.length}`;
      const res = await post(suite.server, route, body, { 'X-Request-Id': id });
      assertError(res, 404, 'model', 'model_not_found');
      assert.ok(res.json.error.message.startsWith(`the model '${body.model}' does not exist`), res.body);
      assert.match(res.body, /\\u0000/);
      for (let i = 0; i < 50 && !suite.server.log.includes(`id=${id}\n`); i++) await new Promise((r) => setTimeout(r, 20));
      const line = suite.server.log.split('\n').find((l) => l.endsWith(`id=${id}`));
      assert.ok(line, suite.server.log.slice(-2000));
      assert.ok(!line.includes('\u0000'), 'a raw NUL in the log');
      const [before_, after_] = body.model.split('\u0000');
      assert.ok(line.includes(`error="the model '${before_}\\u0000${after_}' does not exist`), line);
    }
  });

  it('/metrics has latency, queue and running histograms, process metrics, and valid text format', async () => {
    const before_ = await metrics(suite.server, auth);
    await post(suite.server, '/v1/completions', { model: MODEL, prompt: 'Count me', max_tokens: 3 });
    const res = await rawRequest(suite.server, 'GET', '/metrics', { headers: auth });
    const m = await metrics(suite.server, auth);
    for (const h of ['lily_request_duration_seconds', 'lily_request_queue_seconds', 'lily_request_running_seconds']) {
      assert.match(res.body, new RegExp(`# TYPE ${h} histogram`));
      assert.equal(m.get(`${h}_count`), before_.get(`${h}_count`) + 1, h);
      assert.ok(m.get(`${h}_bucket{le="+Inf"}`) === m.get(`${h}_count`), h);
    }
    // Every phase of a generating request is a counter; the completion above moved them.
    let grew = 0;
    for (const p of ['parse', 'template', 'tokenize', 'queue', 'cache_lookup', 'new_state', 'snapshot', 'prefill',
      'decode', 'cache_store']) {
      const k = `lily_request_phase_seconds_total{phase="${p}"}`;
      assert.ok(m.get(k) >= before_.get(k), k);
      grew += m.get(k) - before_.get(k);
    }
    assert.ok(grew > 0);
    assert.match(res.body, /# TYPE lily_request_phase_seconds_total counter/);
    assert.ok(m.get('process_resident_memory_bytes') > 1e6);
    assert.ok(m.get('process_open_fds') >= 3);
    assert.ok(m.get('process_threads') >= 3);
    assert.ok(m.get('process_cpu_seconds_total') > 0);
    assert.ok(m.get('process_max_fds') >= m.get('process_open_fds'));
    assert.equal(m.get('lily_http_requests_total{route="/v1/completions",status="200"}') > 0, true);
    // Prometheus text format: every sample belongs to a family announced by # TYPE before it.
    const typed = new Set();
    for (const line of res.body.split('\n')) {
      if (line === '') continue;
      const t = line.match(/^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped)$/);
      if (t) { typed.add(t[1]); continue; }
      if (line.startsWith('# HELP ')) continue;
      const s = line.match(/^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*",?)*\})? (-?[0-9.e+-]+|\+Inf|NaN)$/);
      assert.ok(s, `not a valid sample line: ${line}`);
      const family = s[1].replace(/_(bucket|sum|count)$/, '');
      assert.ok(typed.has(s[1]) || typed.has(family), `no # TYPE before ${line}`);
    }
  });

  it('Date header; HTTP/9.9 gets 505; absolute-form targets work', async () => {
    const res = await rawRequest(suite.server, 'GET', '/health');
    assert.ok(Math.abs(Date.parse(res.headers.date) - Date.now()) < 5000, res.headers.date);
    assert.match(res.headers.date, /^[A-Z][a-z]{2}, \d{2} [A-Z][a-z]{2} \d{4} \d{2}:\d{2}:\d{2} GMT$/);
    const v99 = await rawExchange(suite.server, 'GET /health HTTP/9.9\r\nHost: x\r\n\r\n');
    assert.match(v99, /^HTTP\/1\.1 505 /);
    assert.match(v99, /http_version_not_supported/);
    const u = new URL(suite.server.url);
    const abs = await rawExchange(suite.server, `GET http://${u.host}/v1/models?x=1 HTTP/1.1\r\nHost: ${u.host}\r\nAuthorization: Bearer ${KEY}\r\nConnection: close\r\n\r\n`);
    assert.match(abs, /^HTTP\/1\.1 200 /);
    assert.match(abs, /"object":"list"/);
  });

  it('Expect: 100-continue comes only after the key is checked; other Expect values get 417', async () => {
    const body = JSON.stringify({ prompt: 'x' });
    const head = (key, expect = '100-continue') => `POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n` +
      `Content-Length: ${body.length}\r\nExpect: ${expect}\r\n${key ? `Authorization: Bearer ${key}\r\n` : ''}\r\n`;
    const wrong = await rawExchange(suite.server, head('wrong-key'));
    assert.match(wrong, /^HTTP\/1\.1 401 /);
    assert.doesNotMatch(wrong, /100 Continue/);
    const unknown = await rawExchange(suite.server, `${head(KEY, 'something-else')}${body}`);
    assert.match(unknown, /^HTTP\/1\.1 417 /);
    assert.match(unknown, /expectation_failed/);
    // With the key: 100 Continue, then (after the body) the answer.
    const u = new URL(suite.server.url);
    const answer = await new Promise((resolve, reject) => {
      const sock = net.connect({ port: Number(u.port), host: u.hostname });
      let got = '';
      sock.on('connect', () => sock.write(head(KEY)));
      sock.on('data', (c) => {
        got += c.toString();
        if (got.includes('100 Continue') && !got.includes('sent')) { got += '[sent]'; sock.write(body); }
        if (/\r\n\r\n\{"count".*\}/s.test(got)) { sock.destroy(); resolve(got); }
      });
      sock.on('error', reject);
      setTimeout(() => { sock.destroy(); resolve(got); }, 5000);
    });
    assert.match(answer, /^HTTP\/1\.1 100 Continue\r\n\r\n/);
    assert.match(answer, /HTTP\/1\.1 200 OK/);
  });
});

describe('--allowed-origins * and the CLI', () => {
  const suite = serverForSuite(['--allowed-origins', '*']);

  it('* allows any origin without Vary', async () => {
    const res = await rawRequest(suite.server, 'OPTIONS', '/v1/completions', {
      headers: { Origin: 'https://anything.example', 'Access-Control-Request-Method': 'POST' },
    });
    assert.equal(res.status, 204);
    assert.equal(res.headers['access-control-allow-origin'], '*');
    assert.equal(res.headers.vary, undefined);
    const get = await rawRequest(suite.server, 'GET', '/health', { headers: { Origin: 'null' } });
    assert.equal(get.headers['access-control-allow-origin'], '*');
    // Without an Origin there is nothing to allow.
    const none = await rawRequest(suite.server, 'GET', '/health');
    assert.equal(none.headers['access-control-allow-origin'], undefined);
  });

  it('bad --allowed-origins and --port values are refused with a clear message', () => {
    const origins = spawnSync(LILY_BIN, ['serve', '--allowed-origins', 'localhost:3000'], { encoding: 'utf8' });
    assert.notEqual(origins.status, 0);
    assert.match(origins.stderr, /--allowed-origins 'localhost:3000' is not an origin/);
    const port = spawnSync(LILY_BIN, ['serve', '--port', 'abc'], { encoding: 'utf8' });
    assert.notEqual(port.status, 0);
    assert.match(port.stderr, /--port: must be an integer from 0 to 65535, got 'abc'/);
  });
});
