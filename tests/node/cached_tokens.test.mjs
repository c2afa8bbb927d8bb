// Black-box tests of `usage.prompt_tokens_details.cached_tokens` in every shape of answer (chat
// and /v1/completions, whole and streamed, chat with n = 2) and of the prefix-cache counters of
// /metrics against them: each request's hits, misses and tokens saved, and the cached prompt
// tokens, are exactly what its answer reports. A cold request reports 0; the same request again
// resumes all of its prompt but the last token and answers the same.
// Run: LILY_BIN=build/lily node --test tests/node/cached_tokens.test.mjs
import { after, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { MODEL, metrics, rawRequest, startServer, stopServer, waitForMetrics } from './server_harness.mjs';

/** POSTs `doc` to `route`; resolves {texts (one per choice), usage} of a whole or streamed answer. */
async function send(server, route, doc) {
  const body = JSON.stringify(doc);
  const res = await rawRequest(server, 'POST', route, {
    body, headers: { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(body) },
  });
  assert.equal(res.status, 200, res.body);
  const texts = [];
  const add = (index, text) => { texts[index] = (texts[index] ?? '') + (text ?? ''); };
  if (!doc.stream) {
    const json = JSON.parse(res.body);
    for (const c of json.choices) add(c.index, c.message ? c.message.content : c.text);
    return { texts, usage: json.usage };
  }
  let usage = null;
  let done = false;
  for (const event of res.body.split('\n\n')) {
    const line = event.trim();
    if (!line) continue;
    assert.ok(line.startsWith('data: '), line);
    if (line === 'data: [DONE]') { done = true; continue; }
    const chunk = JSON.parse(line.slice(6));
    if (chunk.usage) usage = chunk.usage;
    for (const c of chunk.choices) add(c.index, c.delta ? c.delta.content : c.text);
  }
  assert.ok(done, 'the stream ends with [DONE]');
  assert.ok(usage, 'the stream has a usage chunk');
  return { texts, usage };
}

/** The prefix-cache series a request moves. */
const COUNTERS = ['lily_cache_hits_total', 'lily_cache_misses_total', 'lily_cache_tokens_saved_total',
  'lily_cached_prompt_tokens_total', 'lily_prompt_tokens_total'];

async function counters(server) {
  const m = await metrics(server);
  return Object.fromEntries(COUNTERS.map((k) => [k, m.get(k)]));
}

/** The counters once the request's tokens are counted (a stream's last bytes may come first). */
async function countersAfter(server, before, promptTokens) {
  const m = await waitForMetrics(server, (x) => x.get('lily_prompt_tokens_total') >= before.lily_prompt_tokens_total + promptTokens);
  return Object.fromEntries(COUNTERS.map((k) => [k, m.get(k) - before[k]]));
}

const chatDoc = (content, extra = {}) => ({ model: MODEL, messages: [{ role: 'user', content }], max_tokens: 3, ...extra });
const completionDoc = (prompt, extra = {}) => ({ model: MODEL, prompt, max_tokens: 3, ...extra });
const STREAM = { stream: true, stream_options: { include_usage: true } };

// Each shape with a prompt of its own, so that its first request is cold.
const SHAPES = [
  { name: 'chat', route: '/v1/chat/completions', doc: chatDoc('Shape one: what does a linker do?') },
  { name: 'chat, streamed', route: '/v1/chat/completions', doc: chatDoc('Shape two: what does a compiler do?', STREAM) },
  { name: 'completions', route: '/v1/completions', doc: completionDoc('Shape three: the build system links every target') },
  { name: 'completions, streamed', route: '/v1/completions', doc: completionDoc('Shape four: the package manager resolves', STREAM) },
  { name: 'chat, n = 2', route: '/v1/chat/completions', doc: chatDoc('Shape five: why cache builds?', { n: 2, temperature: 1, seed: 5 }) },
  { name: 'chat, n = 2, streamed', route: '/v1/chat/completions',
    doc: chatDoc('Shape six: why test builds?', { n: 2, temperature: 1, seed: 6, ...STREAM }) },
];

describe('cached_tokens in every answer, and the cache counters of /metrics', () => {
  let server;
  before(async () => { server = await startServer(); });
  after(async () => stopServer(server));

  for (const shape of SHAPES) {
    it(`${shape.name}: 0 cold, all but the last prompt token warm, counted exactly`, async () => {
      const n = shape.doc.n ?? 1;
      let before = await counters(server);
      const cold = await send(server, shape.route, shape.doc);
      const p = cold.usage.prompt_tokens;
      assert.equal(cold.texts.length, n);
      assert.equal(cold.usage.prompt_tokens_details.cached_tokens, 0, JSON.stringify(cold.usage));
      // Choice 0 misses; every later choice resumes from the snapshot choice 0 took one token
      // before the prompt's end. The usage counts the prompt (and its cached part) once, from
      // choice 0.
      assert.deepEqual(await countersAfter(server, before, p), {
        lily_cache_hits_total: n - 1, lily_cache_misses_total: 1, lily_cache_tokens_saved_total: (n - 1) * (p - 1),
        lily_cached_prompt_tokens_total: 0, lily_prompt_tokens_total: p,
      });

      before = await counters(server);
      const warm = await send(server, shape.route, shape.doc);
      assert.equal(warm.usage.prompt_tokens, p);
      assert.equal(warm.usage.prompt_tokens_details.cached_tokens, p - 1, JSON.stringify(warm.usage));
      assert.deepEqual(warm.texts, cold.texts, 'a hit changes no answer');
      assert.deepEqual(await countersAfter(server, before, p), {
        lily_cache_hits_total: n, lily_cache_misses_total: 0, lily_cache_tokens_saved_total: n * (p - 1),
        lily_cached_prompt_tokens_total: p - 1, lily_prompt_tokens_total: p,
      });
    });
  }
});
