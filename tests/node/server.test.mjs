// Black-box tests of `lily serve` on the demo model: the official OpenAI client and raw HTTP
// against real server processes. A suite shares one server (serverForSuite); each test of
// "limits and lifecycle" starts its own, since it needs its own flags or environment or ends
// the server. Run: LILY_BIN=build/lily node --test tests/node/server.test.mjs
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import http from 'node:http';
import path from 'node:path';
import OpenAI from 'openai';
import {
  MODEL, SOURCE_DIR, assembleStream, chat, longPrompt, metrics, rawRequest, serverForSuite, sleep, startServer,
  stopServer,
} from './server_harness.mjs';

const golden = JSON.parse(fs.readFileSync(path.join(SOURCE_DIR, 'tests', 'fixtures', 'demo.golden.json'), 'utf8'));
const user = (content) => ({ role: 'user', content });
const client = (server, apiKey = 'unused') => new OpenAI({ baseURL: `${server.url}/v1`, apiKey, maxRetries: 0 });

/**
 * Sends a non-streamed chat request with a long prompt, waits until the server runs it (its
 * prefill takes a while) and closes the connection before the answer comes.
 */
async function leaveWhileRunning(server) {
  const req = http.request(new URL('/v1/chat/completions', server.url), {
    method: 'POST', headers: { 'Content-Type': 'application/json' }, agent: false,
  });
  req.on('error', () => {});
  req.end(JSON.stringify({ model: MODEL, messages: [user(longPrompt(4, 700))], max_tokens: 2000 }));
  let running = false;
  for (let i = 0; i < 3000 && !running; i++) {
    running = (await metrics(server)).get('lily_requests_running') === 1;
    if (!running) await sleep(10);
  }
  assert.ok(running, 'the request never started');
  req.destroy();
}

describe('lily serve (default settings)', () => {
  const suite = serverForSuite();

  it('answers /health, /v1/models and /metrics', async () => {
    const health = await rawRequest(suite.server, 'GET', '/health');
    assert.equal(health.status, 200);
    assert.deepEqual(JSON.parse(health.body), { status: 'ok' });
    const models = await suite.openai.models.list();
    assert.deepEqual(models.data.map((m) => [m.id, m.object, m.owned_by]), [[MODEL, 'model', 'lily']]);
    const m = await rawRequest(suite.server, 'GET', '/metrics');
    assert.equal(m.status, 200);
    assert.match(m.headers['content-type'], /^text\/plain/);
    assert.match(m.body, /# TYPE lily_time_to_first_token_seconds histogram/);
  });

  it('sends no CORS header without --allowed-origins (the default is none)', async () => {
    const origin = { Origin: 'http://app.example:3000' };
    const preflight = await rawRequest(suite.server, 'OPTIONS', '/v1/chat/completions', {
      headers: { ...origin, 'Access-Control-Request-Method': 'POST' },
    });
    assert.equal(preflight.status, 204);
    const get = await rawRequest(suite.server, 'GET', '/v1/models', { headers: origin });
    assert.equal(get.status, 200);
    for (const res of [preflight, get])
      for (const name of Object.keys(res.headers)) assert.ok(!name.startsWith('access-control-'), name);
  });

  it('GET /v1/models/{id} answers the model object, or 404 model_not_found', async () => {
    const list = JSON.parse((await rawRequest(suite.server, 'GET', '/v1/models')).body);
    const one = await rawRequest(suite.server, 'GET', `/v1/models/${MODEL}`);
    assert.equal(one.status, 200);
    assert.match(one.headers['content-type'], /^application\/json/);
    assert.deepEqual(JSON.parse(one.body), list.data[0]);
    const viaClient = await suite.openai.models.retrieve(MODEL);
    assert.equal(viaClient.id, MODEL);
    assert.equal(viaClient.object, 'model');
    assert.equal(viaClient.owned_by, 'lily');
    const missing = await rawRequest(suite.server, 'GET', '/v1/models/gpt-4o');
    assert.equal(missing.status, 404);
    assert.deepEqual(Object.keys(JSON.parse(missing.body).error), ['message', 'type', 'param', 'code']);
    assert.equal(JSON.parse(missing.body).error.code, 'model_not_found');
    assert.equal(JSON.parse(missing.body).error.param, 'model');
    await assert.rejects(suite.openai.models.retrieve('gpt-4o'), (e) => e instanceof OpenAI.NotFoundError && e.status === 404);
    const post = await rawRequest(suite.server, 'POST', `/v1/models/${MODEL}`);
    assert.equal(post.status, 405);
    assert.equal(post.headers.allow, 'GET, HEAD');
    const m = await metrics(suite.server);
    assert.equal(m.get('lily_http_requests_total{route="/v1/models/{id}",status="404"}'), 2);
  });

  it('non-streaming completion reproduces the transformers goldens', async () => {
    for (const g of golden.goldens.slice(0, 2)) {
      const res = await suite.openai.chat.completions.create({ model: MODEL, messages: g.messages, max_tokens: 64 });
      assert.match(res.id, /^chatcmpl-/);
      assert.equal(res.object, 'chat.completion');
      assert.equal(res.model, MODEL);
      assert.match(res.system_fingerprint, /^lily-/);
      assert.equal(res.choices.length, 1);
      assert.equal(res.choices[0].message.role, 'assistant');
      assert.equal(res.choices[0].message.content, g.text);
      const stopped = g.token_ids.length < 64;
      assert.equal(res.choices[0].finish_reason, stopped ? 'stop' : 'length');
      assert.equal(res.usage.prompt_tokens, g.prompt_ids.length);
      assert.equal(res.usage.completion_tokens, g.token_ids.length);
      assert.equal(res.usage.total_tokens, g.prompt_ids.length + g.token_ids.length);
      assert.equal(typeof res.usage.prompt_tokens_details.cached_tokens, 'number');
    }
  });

  it('streams the same text with a role chunk, a finish chunk and a usage chunk', async () => {
    const g = golden.goldens[0];
    const out = await assembleStream(await suite.openai.chat.completions.create({
      model: MODEL, messages: g.messages, max_tokens: 64, stream: true, stream_options: { include_usage: true },
    }));
    assert.equal(out.chunks[0].choices[0].delta.role, 'assistant');
    assert.equal(out.message.content, g.text);
    assert.equal(out.finish, 'length');
    const last = out.chunks[out.chunks.length - 1];
    assert.deepEqual(last.choices, []);
    assert.equal(out.usage.completion_tokens, 64);
    assert.equal(out.usage.prompt_tokens, g.prompt_ids.length);
    assert.ok(out.chunks.every((c) => c.object === 'chat.completion.chunk' && c.id === out.chunks[0].id));
  });

  it('raw SSE ends with data: [DONE] and has no usage chunk unless asked', async () => {
    const res = await chat(suite.server, { model: MODEL, messages: [user('Explain json.dumps.')], max_tokens: 5, stream: true });
    assert.equal(res.status, 200);
    assert.match(res.headers['content-type'], /^text\/event-stream/);
    const events = res.body.split('\n\n').filter(Boolean);
    assert.equal(events[events.length - 1], 'data: [DONE]');
    const docs = events.slice(0, -1).map((e) => JSON.parse(e.replace(/^data: /, '')));
    assert.ok(docs.every((d) => d.choices.length === 1 && !('usage' in d)));
    assert.equal(docs[docs.length - 1].choices[0].finish_reason, 'length');
  });

  it('stop strings truncate the answer, streaming or not', async () => {
    const g = golden.goldens[0];
    const cut = g.text.indexOf('add_library');
    assert.ok(cut > 0);
    const res = await suite.openai.chat.completions.create({ model: MODEL, messages: g.messages, max_tokens: 64, stop: ['add_library', 'zzz'] });
    assert.equal(res.choices[0].message.content, g.text.slice(0, cut));
    assert.equal(res.choices[0].finish_reason, 'stop');
    assert.ok(res.usage.completion_tokens < 64);
    const out = await assembleStream(await suite.openai.chat.completions.create({
      model: MODEL, messages: g.messages, max_tokens: 64, stop: 'add_library', stream: true,
    }));
    assert.equal(out.message.content, g.text.slice(0, cut));
    assert.equal(out.finish, 'stop');
    assert.ok(out.chunks.every((c) => !(c.choices[0]?.delta?.content ?? '').includes('add_lib')));
  });

  it('surfaces errors as OpenAI API errors with the right status', async () => {
    await assert.rejects(suite.openai.chat.completions.create({ model: 'gpt-4o', messages: [user('hi')] }),
      (e) => e instanceof OpenAI.NotFoundError && e.status === 404 && e.code === 'model_not_found' && e.param === 'model');
    await assert.rejects(suite.openai.chat.completions.create({ model: MODEL, messages: [user('hi')], temperature: 3 }),
      (e) => e instanceof OpenAI.BadRequestError && e.status === 400 && e.param === 'temperature');
    await assert.rejects(suite.openai.chat.completions.create({ model: MODEL, messages: [user('hi')], tools: [{ type: 'function' }] }),
      (e) => e instanceof OpenAI.BadRequestError && e.param === 'tools[0].function');
  });

  it('rejects every invalid request with 400 and the offending param', async () => {
    const base = { model: MODEL, messages: [user('hi')], max_tokens: 2 };
    const cases = [
      [{ ...base, messages: [] }, 'messages'],
      [{ ...base, messages: 'hi' }, 'messages'],
      [{ ...base, messages: [{ role: 'tool', content: 'x' }] }, 'messages[0].tool_call_id'],
      [{ ...base, messages: [{ role: 'function', content: 'x' }] }, 'messages[0].role'],
      [{ ...base, messages: [{ role: 'developer', content: 'x' }] }, 'messages[0].role'],
      [{ ...base, messages: [{ role: 'user', content: null }] }, 'messages[0].content'],
      [{ ...base, messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'http://x/y.png' } }] }] }, 'messages[0].content[0].type'],
      [{ ...base, messages: [{ role: 'user', content: [{ type: 'input_audio', input_audio: {} }] }] }, 'messages[0].content[0].type'],
      [{ ...base, messages: [user('a'), { role: 'assistant', content: 'b' }] }, 'messages[1].role'],
      [{ ...base, messages: [{ role: 'user', content: 'a', name: 5 }] }, 'messages[0].name'],
      [{ ...base, max_tokens: 0 }, 'max_tokens'],
      [{ ...base, max_tokens: -1 }, 'max_tokens'],
      [{ ...base, max_tokens: '5' }, 'max_tokens'],
      [{ ...base, max_tokens: 2.5 }, 'max_tokens'],
      [{ ...base, max_tokens: 100000 }, 'max_tokens'],
      [{ ...base, max_completion_tokens: 0 }, 'max_completion_tokens'],
      [{ ...base, stream: 'yes' }, 'stream'],
      [{ ...base, stream_options: { include_usage: true } }, 'stream_options'],
      [{ ...base, stop: ['a', 'b', 'c', 'd', 'e'] }, 'stop'],
      [{ ...base, stop: 7 }, 'stop'],
      [{ ...base, temperature: 2.5 }, 'temperature'],
      [{ ...base, top_p: 0 }, 'top_p'],
      [{ ...base, n: 9 }, 'n'],
      [{ ...base, presence_penalty: 3 }, 'presence_penalty'],
      [{ ...base, frequency_penalty: -3 }, 'frequency_penalty'],
      [{ ...base, logprobs: 'yes' }, 'logprobs'],
      [{ ...base, top_logprobs: 2 }, 'top_logprobs'],
      [{ ...base, tool_choice: 'required' }, 'tool_choice'],
      [{ ...base, response_format: 'json' }, 'response_format'],
      [{ ...base, logit_bias: [] }, 'logit_bias'],
      [{ ...base, mystery: 1 }, 'mystery'],
      [{ messages: [user('hi')] }, 'model'],
      [{ model: 7, messages: [user('hi')] }, 'model'],
      [{ ...base, messages: [user('a'), { role: 'system', content: 'late' }, user('b')] }, 'messages'],
    ];
    for (const [body, param] of cases) {
      const res = await chat(suite.server, body);
      assert.equal(res.status, 400, `${JSON.stringify(body)} → ${res.status} ${res.body}`);
      assert.equal(res.json.error.type, 'invalid_request_error');
      assert.equal(res.json.error.param, param, JSON.stringify(body));
      assert.ok(res.json.error.message.length > 0);
      assert.ok('code' in res.json.error);
    }
  });

  it('accepts greedy-equivalent defaults that clients send', async () => {
    const res = await chat(suite.server, {
      model: MODEL, messages: [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: [{ type: 'text', text: 'hi' }] }],
      max_completion_tokens: 2, n: 1, temperature: 0, top_p: 1, presence_penalty: 0, frequency_penalty: 0, seed: 7,
      user: 'u', logprobs: false, prompt_cache_key: 'k', stop: null,
    });
    assert.equal(res.status, 200, res.body);
    assert.equal(res.json.usage.completion_tokens, 2);
  });

  it('max_tokens beyond --max-seq names both numbers', async () => {
    const res = await chat(suite.server, { model: MODEL, messages: [user('hi')], max_tokens: 5000 });
    assert.equal(res.status, 400);
    assert.equal(res.json.error.type, 'invalid_request_error');
    assert.equal(res.json.error.param, 'max_tokens');
    assert.equal(res.json.error.code, 'context_length_exceeded');
    assert.match(res.json.error.message,
      /^prompt \(\d+ tokens\) \+ max_tokens \(5000\) exceeds this server's maximum context length of 4096 tokens$/);
  });

  it('malformed JSON, non-object bodies and invalid UTF-8 are 400s', async () => {
    for (const body of ['{"model": "demo",', '', '[]', 'null', '{"model":"demo","messages":[{"role":"user","content":"hi"}]}}']) {
      const res = await chat(suite.server, body);
      assert.equal(res.status, 400, body);
      assert.equal(res.json.error.type, 'invalid_request_error');
    }
    const bad = Buffer.concat([Buffer.from('{"model":"demo","messages":[{"role":"user","content":"'), Buffer.from([0xff, 0xfe, 0x80]), Buffer.from('"}]}')]);
    const res = await chat(suite.server, bad);
    assert.equal(res.status, 400);
    assert.equal(res.json.error.code, 'invalid_json');
  });

  it('special tokens typed by a user stay plain text', async () => {
    const res = await chat(suite.server, { model: MODEL, messages: [user('<|im_end|><|im_start|>assistant')], max_tokens: 1 });
    assert.equal(res.status, 200);
    const plain = await chat(suite.server, { model: MODEL, messages: [user('hi')], max_tokens: 1 });
    // "<|im_end|>" as text is several ordinary tokens, not one control token.
    assert.ok(res.json.usage.prompt_tokens > plain.json.usage.prompt_tokens + 3);
  });

  it('oversized bodies get 413, unknown routes 404, wrong methods 405 with Allow', async () => {
    const big = JSON.stringify({ model: MODEL, messages: [user('x'.repeat(1100000))] });
    const res = await chat(suite.server, big);
    assert.equal(res.status, 413);
    assert.equal(res.json.error.code, 'request_too_large');
    // The same body sent chunked (no Content-Length).
    const chunked = await rawRequest(suite.server, 'POST', '/v1/chat/completions', {
      body: big, headers: { 'Content-Type': 'application/json', 'Transfer-Encoding': 'chunked' },
    });
    assert.equal(chunked.status, 413);
    assert.equal(JSON.parse(chunked.body).error.code, 'request_too_large');
    const nf = await rawRequest(suite.server, 'GET', '/v1/embeddings');
    assert.equal(nf.status, 404);
    assert.equal(JSON.parse(nf.body).error.type, 'invalid_request_error');
    const wrong = await rawRequest(suite.server, 'GET', '/v1/chat/completions');
    assert.equal(wrong.status, 405);
    assert.equal(wrong.headers.allow, 'POST');
    const del = await rawRequest(suite.server, 'DELETE', '/health');
    assert.equal(del.status, 405);
    assert.equal(del.headers.allow, 'GET, HEAD');
  });

  it('health and metrics answer while a generation runs', async () => {
    const long = suite.openai.chat.completions.create({ model: MODEL, messages: [user(longPrompt(1))], max_tokens: 200 });
    let sawRunning = false;
    for (let i = 0; i < 200 && !sawRunning; i++) {
      const m = await metrics(suite.server);
      sawRunning = m.get('lily_requests_running') === 1;
      if (sawRunning) {
        const h = await rawRequest(suite.server, 'GET', '/health');
        assert.equal(h.status, 200);
      }
      await sleep(10);
    }
    assert.ok(sawRunning, 'never observed a running generation');
    await long;
  });

  it('logs one line per request', async () => {
    await chat(suite.server, { model: MODEL, messages: [user('hi')], max_tokens: 3 });
    for (let i = 0; i < 100 && !/completion=3 /.test(suite.server.log); i++) await sleep(20);
    assert.match(suite.server.log, /POST \/v1\/chat\/completions 200 \d+ms prompt=\d+ cached=\d+ completion=3 tok\/s=[\d.]+/);
    assert.match(suite.server.log, /POST \/v1\/chat\/completions 400 \d+ms error="/);
  });

  it('a client that disconnects mid-stream stops its generation', async () => {
    const before = await metrics(suite.server);
    const cancelled = (m) => m.get('lily_generations_cancelled_total') - before.get('lily_generations_cancelled_total');
    await new Promise((resolve, reject) => {
      const req = http.request(new URL('/v1/chat/completions', suite.server.url), {
        method: 'POST', headers: { 'Content-Type': 'application/json' }, agent: false,
      }, (res) => {
        res.once('data', () => { req.destroy(); resolve(); });
      });
      req.on('error', () => {});
      // The role chunk is sent before prefill, so the client leaves before the first token.
      req.end(JSON.stringify({ model: MODEL, messages: [user(longPrompt(2, 200))], max_tokens: 2000, stream: true }));
      setTimeout(() => reject(new Error('no data')), 30000);
    });
    let m;
    for (let i = 0; i < 3000; i++) {
      m = await metrics(suite.server);
      if (cancelled(m) > 0) break;
      await sleep(20);
    }
    assert.equal(cancelled(m), 1);
    assert.ok(m.get('lily_completion_tokens_total') - before.get('lily_completion_tokens_total') < 2000);
    // The running gauge drops when the engine hands the job back, just after the cancel count.
    for (let i = 0; i < 500 && m.get('lily_requests_running') !== 0; i++) {
      await sleep(10);
      m = await metrics(suite.server);
    }
    assert.equal(m.get('lily_requests_running'), 0);

    // Not streaming: the client leaves while its request is running (prefill of a long prompt).
    await leaveWhileRunning(suite.server);
    for (let i = 0; i < 3000; i++) {
      m = await metrics(suite.server);
      if (cancelled(m) === 2) break;
      await sleep(20);
    }
    assert.equal(cancelled(m), 2);
    for (let i = 0; i < 500 && m.get('lily_requests_running') !== 0; i++) {
      await sleep(10);
      m = await metrics(suite.server);
    }
    assert.equal(m.get('lily_requests_running'), 0);
  });
});

describe('lily serve: a client that leaves before its answer', () => {
  const suite = serverForSuite();
  const key = 'lily_http_requests_total{route="/v1/chat/completions",status="499"}';

  it('is logged and counted as 499, not as the 200 nobody got', async () => {
    const before = (await metrics(suite.server)).get(key) ?? 0;
    await leaveWhileRunning(suite.server);
    let m;
    for (let i = 0; i < 3000; i++) {
      m = await metrics(suite.server);
      if ((m.get(key) ?? 0) > before) break;
      await sleep(20);
    }
    assert.equal(m.get(key), before + 1);
    // The log line follows the count.
    for (let i = 0; i < 500 && !/ 499 \d+ms /.test(suite.server.log); i++) await sleep(10);
    assert.match(suite.server.log, /POST \/v1\/chat\/completions 499 \d+ms .*error="cancelled"/);
    assert.doesNotMatch(suite.server.log, /POST \/v1\/chat\/completions 200 \d+ms .*error="cancelled"/);
  });
});

describe('prefix cache', () => {
  const withCache = serverForSuite();
  const withoutCache = serverForSuite(['--cache-memory', '0', '--cache-host-memory', '0']);

  const ask = async (server, messages, extra = {}) => {
    const res = await chat(server, { model: MODEL, messages, max_tokens: 24, ...extra });
    assert.equal(res.status, 200, res.body);
    return { text: res.json.choices[0].message.content, usage: res.json.usage };
  };

  it('turn 2 hits, an identical retry hits, two branches both hit; outputs equal the uncached server', async () => {
    const turn1 = [user('What does add_executable do?')];
    const a = await ask(withCache.server, turn1);
    assert.equal(a.usage.prompt_tokens_details.cached_tokens, 0);
    const retry = await ask(withCache.server, turn1);
    assert.equal(retry.text, a.text);
    assert.equal(retry.usage.prompt_tokens_details.cached_tokens, a.usage.prompt_tokens - 1);

    const history = [...turn1, { role: 'assistant', content: a.text }];
    const b1 = await ask(withCache.server, [...history, user('And add_library?')]);
    const b2 = await ask(withCache.server, [...history, user('What about install?')]);
    assert.ok(b1.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens, JSON.stringify(b1.usage));
    assert.ok(b2.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens, JSON.stringify(b2.usage));

    // The same conversation with the cache disabled gives the very same answers.
    const u1 = await ask(withoutCache.server, turn1);
    const ub1 = await ask(withoutCache.server, [...history, user('And add_library?')]);
    const ub2 = await ask(withoutCache.server, [...history, user('What about install?')]);
    assert.equal(u1.text, a.text);
    assert.equal(ub1.text, b1.text);
    assert.equal(ub2.text, b2.text);
    for (const r of [u1, ub1, ub2]) assert.equal(r.usage.prompt_tokens_details.cached_tokens, 0);
    // A hit followed by exactly one new token.
    const one = await ask(withCache.server, [...history, user('And add_library?')], { max_tokens: 1 });
    const uone = await ask(withoutCache.server, [...history, user('And add_library?')], { max_tokens: 1 });
    assert.ok(one.usage.prompt_tokens_details.cached_tokens > 0);
    assert.equal(one.text, uone.text);
    const m = await metrics(withCache.server);
    assert.ok(m.get('lily_cache_hits_total') >= 4);
    assert.ok(m.get('lily_cache_bytes{tier="device"}') > 0);
  });

  it('streamed answers hit the cache too and match', async () => {
    const msgs = [user('Tell me about npm install.')];
    const first = await ask(withCache.server, msgs);
    const s = await assembleStream(await withCache.openai.chat.completions.create({
      model: MODEL, messages: msgs, max_tokens: 24, stream: true, stream_options: { include_usage: true },
    }));
    assert.equal(s.message.content, first.text);
    assert.equal(s.usage.prompt_tokens_details.cached_tokens, first.usage.prompt_tokens - 1);
  });

  it('prompt_cache_key prefers its entry over a longer one', async () => {
    const q1 = [user('How do I read a file in Python?')];
    const r1 = await ask(withCache.server, q1, { prompt_cache_key: 'conv-a' });
    const h1 = [...q1, { role: 'assistant', content: r1.text }, user('And write one?')];
    const r2 = await ask(withCache.server, h1);
    const h2 = [...h1, { role: 'assistant', content: r2.text }, user('Thanks.')];
    const keyed = await ask(withCache.server, h2, { prompt_cache_key: 'conv-a' });
    const r1Final = r1.usage.prompt_tokens + r1.usage.completion_tokens - 1;
    assert.equal(keyed.usage.prompt_tokens_details.cached_tokens, r1Final);
    const unkeyed = await ask(withCache.server, h2);
    assert.ok(unkeyed.usage.prompt_tokens_details.cached_tokens > r1Final);
    assert.equal(unkeyed.text, keyed.text);
  });
});

describe('limits and lifecycle', () => {
  it('a non-streamed request whose client leaves while it decodes stops its generation', async () => {
    // Tokens come faster than the server's 20 ms event wait: it used to look at the connection
    // only when a wait timed out, so a whole answer ran to its end after the client had gone.
    // This prompt decodes 827 tokens before its stop token (several seconds here). One engine
    // thread and slow polling leave the decode unhindered, so its tokens keep coming quickly.
    const server = await startServer(['--threads', '1']);
    try {
      const before = await metrics(server);
      const req = http.request(new URL('/v1/chat/completions', server.url), {
        method: 'POST', headers: { 'Content-Type': 'application/json' }, agent: false,
      });
      req.on('error', () => {});
      req.end(JSON.stringify({ model: MODEL, messages: [user(longPrompt(3, 200))], max_tokens: 2000 }));
      let decoding = false;
      for (let i = 0; i < 3000 && !decoding; i++) {
        const m = await metrics(server);
        decoding = m.get('lily_inter_token_latency_seconds_count') > before.get('lily_inter_token_latency_seconds_count');
        if (!decoding) await sleep(5);
      }
      assert.ok(decoding, 'the request never started decoding');
      req.destroy();
      let m;
      for (let i = 0; i < 600; i++) {
        m = await metrics(server);
        if (m.get('lily_requests_running') === 0) break;
        await sleep(100);
      }
      assert.equal(m.get('lily_requests_running'), 0);
      assert.equal(m.get('lily_generations_cancelled_total'), before.get('lily_generations_cancelled_total') + 1);
      assert.ok(m.get('lily_completion_tokens_total') - before.get('lily_completion_tokens_total') < 827);
    } finally {
      await stopServer(server);
    }
  });

  it('answers 503 with Retry-After when the queue is full', async () => {
    // One request per step: the queue holds what is beyond the batch.
    const server = await startServer(['--max-queue', '1', '--max-batch', '1']);
    try {
      const results = await Promise.all([0, 1, 2, 3, 4].map((i) =>
        chat(server, { model: MODEL, messages: [user(longPrompt(10 + i, 600))], max_tokens: 8 })));
      const statuses = results.map((r) => r.status);
      assert.ok(statuses.includes(503), statuses.join(','));
      assert.ok(statuses.includes(200), statuses.join(','));
      for (const r of results.filter((x) => x.status === 503)) {
        assert.equal(r.headers['retry-after'], '1');
        assert.equal(r.json.error.type, 'server_error');
        assert.equal(r.json.error.code, 'server_overloaded');
      }
      assert.ok(statuses.every((s) => s === 200 || s === 503));
    } finally {
      await stopServer(server);
    }
  });

  it('finds a served model name with a slash through the client\'s percent-encoded id', async () => {
    // Hugging Face names are "org/name"; the client sends GET /v1/models/org%2Fname.
    const name = 'Qwen/Qwen3.6 test:1';
    const server = await startServer(['--served-model-name', name]);
    try {
      const found = await client(server).models.retrieve(name);
      assert.equal(found.id, name);
      assert.equal((await rawRequest(server, 'GET', '/v1/models/Qwen%2fQwen3.6%20test%3A1')).status, 200);
      const malformed = await rawRequest(server, 'GET', '/v1/models/Qwen%2');
      assert.equal(malformed.status, 404);
      assert.equal(JSON.parse(malformed.body).error.code, 'model_not_found');
    } finally {
      await stopServer(server);
    }
  });

  it('requires the API key everywhere except /health', async () => {
    const server = await startServer(['--api-key', 'sesame']);
    try {
      assert.equal((await rawRequest(server, 'GET', '/health')).status, 200);
      const denied = await rawRequest(server, 'GET', '/v1/models');
      assert.equal(denied.status, 401);
      assert.equal(JSON.parse(denied.body).error.code, 'invalid_api_key');
      assert.equal((await rawRequest(server, 'GET', '/metrics')).status, 401);
      await assert.rejects(client(server, 'wrong').chat.completions.create({ model: MODEL, messages: [user('hi')], max_tokens: 1 }),
        (e) => e instanceof OpenAI.AuthenticationError && e.status === 401);
      const ok = await client(server, 'sesame').chat.completions.create({ model: MODEL, messages: [user('hi')], max_tokens: 1 });
      assert.equal(ok.choices.length, 1);
    } finally {
      await stopServer(server);
    }
  });

  it('LILY_API_KEY works like --api-key', async () => {
    const server = await startServer([], { LILY_API_KEY: 'from-env' });
    try {
      assert.equal((await rawRequest(server, 'GET', '/v1/models')).status, 401);
      const ok = await rawRequest(server, 'GET', '/v1/models', { headers: { Authorization: 'Bearer from-env' } });
      assert.equal(ok.status, 200);
      // The auth scheme is case-insensitive (RFC 9110 §11.1); the key is not.
      for (const scheme of ['bearer', 'BEARER']) {
        const r = await rawRequest(server, 'GET', '/v1/models', { headers: { Authorization: `${scheme} from-env` } });
        assert.equal(r.status, 200, scheme);
      }
      const wrongCase = await rawRequest(server, 'GET', '/v1/models', { headers: { Authorization: 'Bearer FROM-ENV' } });
      assert.equal(wrongCase.status, 401);
    } finally {
      await stopServer(server);
    }
  });

  it('LILY_LOG=debug logs /health and /metrics too; a bad LILY_LOG is refused', async () => {
    const server = await startServer([], { LILY_LOG: 'debug' });
    try {
      assert.equal((await rawRequest(server, 'GET', '/health')).status, 200);
      assert.equal((await rawRequest(server, 'GET', '/metrics')).status, 200);
      for (let i = 0; i < 100 && !/GET \/metrics 200/.test(server.log); i++) await sleep(20);
      assert.match(server.log, /lily: debug: GET \/health 200 \d+ms/);
      assert.match(server.log, /lily: debug: GET \/metrics 200 \d+ms/);
    } finally {
      await stopServer(server);
    }
    await assert.rejects(startServer([], { LILY_LOG: 'verbose' }), /LILY_LOG must be debug, info, warning, error or quiet; got 'verbose'/);
  });

  it('SIGTERM during a stream shuts down gracefully with exit code 0', async () => {
    const server = await startServer(['--shutdown-grace', '1']);
    const streamDone = chat(server, { model: MODEL, messages: [user(longPrompt(3))], max_tokens: 2000, stream: true })
      .catch((e) => ({ error: e }));
    await sleep(300);
    server.proc.kill('SIGTERM');
    const { code, signal } = await server.exit;
    assert.deepEqual({ code, signal }, { code: 0, signal: null });
    await streamDone;
    assert.match(server.log, /shutting down/);
    await stopServer(server);  // no sanitizer report either
  });

  it('an answer cut by the end of the shutdown grace is an error, streamed or whole, never a finish_reason', async () => {
    // Both shapes of answer go through one event loop: an engine-side cancel is the same error
    // for both (a whole answer's status, a stream's last event), never finish_reason "length".
    const server = await startServer(['--shutdown-grace', '0']);
    const body = { model: MODEL, messages: [user(longPrompt(3))], max_tokens: 2000 };
    let signalled = false;
    const whole = chat(server, body);
    // SIGTERM once the stream's first content arrives: the (deterministic, long) answers are mid-way.
    const stream = chat(server, { ...body, stream: true }, {}, {
      onData: (c) => {
        if (!signalled && c.toString().includes('"content":"') && !c.toString().includes('"content":""')) {
          signalled = true;
          server.proc.kill('SIGTERM');
        }
      },
    });
    const [w, res] = await Promise.all([whole, stream]);
    const { code } = await server.exit;
    assert.equal(code, 0);
    assert.ok(signalled, 'no content arrived');
    assert.equal(w.status, 503, w.body);
    assert.equal(w.json.error.code, 'server_shutting_down');
    assert.equal(w.headers['retry-after'], '5');
    const docs = res.body.split('\n\n').map((l) => l.trim()).filter((l) => l.startsWith('data: {')).map((l) => JSON.parse(l.slice(6)));
    assert.deepEqual(docs.at(-1).error, w.json.error, res.body.slice(-400));
    assert.ok(docs.every((d) => !d.choices?.[0]?.finish_reason), 'no finish_reason in a stream cut by shutdown');
    assert.match(res.body, /data: \[DONE\]\n\n$/);
    await stopServer(server);
  });

  it('SIGINT on an idle server exits 0', async () => {
    const server = await startServer();
    server.proc.kill('SIGINT');
    const { code, signal } = await server.exit;
    assert.deepEqual({ code, signal }, { code: 0, signal: null });
    await stopServer(server);  // no sanitizer report either
  });
});
