// Black-box tests of the prefix cache of `lily serve` on the demo model: conversations sharing a
// system prompt resume after it, many interleaved conversations all hit their own first turn
// with the default budgets, so do conversations sent concurrently (batched), /v1/completions
// reports cached tokens, the byte budgets of both tiers hold (with evictions counted per tier),
// and answers are the same cold, warm and with the cache disabled.
// Run: LILY_BIN=build/lily node --test tests/node/prefix_cache.test.mjs
import { after, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { MODEL, chat, metrics, postJson, startServer, stopServer } from './server_harness.mjs';

const system = (content) => ({ role: 'system', content });
const user = (content) => ({ role: 'user', content });
const assistant = (content) => ({ role: 'assistant', content });

/** A system prompt of about 300 tokens on the demo tokenizer. */
const SYSTEM = ['You are the support assistant of a build tool company.']
  .concat(Array.from({ length: 16 }, (_, i) => `Rule ${i + 1}: answer briefly, cite the manual and stay polite.`))
  .join(' ');

async function ask(server, messages, extra = {}) {
  const res = await chat(server, { model: MODEL, messages, max_tokens: 8, ...extra });
  assert.equal(res.status, 200, res.body);
  return { text: res.json.choices[0].message.content, usage: res.json.usage };
}

/** postJson, expecting 200; resolves the answer's JSON. */
async function post(server, urlPath, doc) {
  const res = await postJson(server, urlPath, doc);
  assert.equal(res.status, 200, JSON.stringify(res.json));
  return res.json;
}

const cached = (r) => r.usage.prompt_tokens_details.cached_tokens;

describe('prefix cache with the default budgets', () => {
  let warm;
  let disabled;
  before(async () => {
    [warm, disabled] = await Promise.all([
      startServer(), startServer(['--cache-memory', '0', '--cache-host-memory', '0'])]);
  });
  after(async () => Promise.all([stopServer(warm), stopServer(disabled)]));

  it('three conversations sharing a 300-token system prompt: the 2nd and 3rd resume after it', async () => {
    // The system message as the template renders it, up to where the next message begins:
    // exactly the tokens a resume point ends at.
    const imStart = (await post(warm, '/tokenize', { prompt: '<|im_start|>' })).tokens[0];
    const rendered = await post(warm, '/tokenize', { messages: [system(SYSTEM), user('x')], add_generation_prompt: false });
    const sys = { count: rendered.tokens.indexOf(imStart, 1) };
    assert.ok(sys.count >= 300, `system prompt has ${sys.count} tokens`);
    const questions = ['How do I install it?', 'Why is my build slow?', 'Can builds be cached remotely?'];
    for (const [i, q] of questions.entries()) {
      for (const sampling of [{}, { temperature: 0.9, seed: 7 + i }]) {
        const messages = [system(SYSTEM + (sampling.seed ? ' Be friendly.' : '')), user(q)];
        const w = await ask(warm, messages, sampling);
        const d = await ask(disabled, messages, sampling);
        assert.equal(w.text, d.text, `${q} ${JSON.stringify(sampling)}`);
        assert.equal(cached(d), 0);
        if (i === 0) assert.equal(cached(w), 0);
        else assert.ok(cached(w) >= sys.count, `${q}: ${JSON.stringify(w.usage)}`);
      }
    }
    const m = await metrics(warm);
    assert.ok(m.get('lily_cache_tokens_saved_total') >= 4 * sys.count);
    assert.ok(m.get('lily_cache_hits_total') >= 4);
    const off = await metrics(disabled);
    assert.equal(off.get('lily_cache_hits_total'), 0);
    assert.equal(off.get('lily_cache_budget_bytes{tier="device"}'), 0);
    assert.equal(off.get('lily_cache_snapshots{tier="device"}'), 0);
  });

  it('50 interleaved two-turn conversations: every turn 2 hits its turn 1', async () => {
    const n = 50;
    const firsts = [];
    for (let i = 0; i < n; i++) {
      const messages = [user(`Conversation ${i}: what does target_link_libraries do for target ${i}?`)];
      firsts.push({ messages, answer: await ask(warm, messages, { max_tokens: 4 }) });
    }
    for (const [i, { messages, answer }] of firsts.entries()) {
      const turn2 = [...messages, assistant(answer.text), user(`And for target ${i + 100}?`)];
      const r = await ask(warm, turn2, { max_tokens: 4 });
      // At least turn 1's own prompt minus its last token: a snapshot only turn 1 can have made
      // (usually more: turn 1's final state, when its answer encodes back to the same tokens).
      assert.ok(cached(r) >= answer.usage.prompt_tokens - 1, `conversation ${i}: ${JSON.stringify(r.usage)}`);
    }
    const m = await metrics(warm);
    assert.ok(m.get('lily_cache_snapshots{tier="device"}') >= 2 * n);
    assert.equal(m.get('lily_cache_evictions_total{tier="device"}'), 0);
  });

  it('concurrent conversations through the batched scheduler: every turn 2 hits its turn 1, answers as uncached', async () => {
    const n = 6;
    // Steps that advanced more than one sequence: the conversations really shared steps.
    const shared = (m) => m.get('lily_step_batch_size_count') - m.get('lily_step_batch_size_bucket{le="1"}');
    const before = await metrics(warm);
    const turn1 = Array.from({ length: n }, (_, i) =>
      [system(SYSTEM + ' Reply in one line.'), user(`Concurrent ${i}: which flags speed up target ${i}?`)]);
    const askAll = (server, conversations) => Promise.all(conversations.map((m) => ask(server, m, { max_tokens: 6 })));
    const [firsts, firstsOff] = await Promise.all([askAll(warm, turn1), askAll(disabled, turn1)]);
    const turn2 = turn1.map((m, i) => [...m, assistant(firsts[i].text), user('And in debug builds?')]);
    const [seconds, secondsOff] = await Promise.all([askAll(warm, turn2), askAll(disabled, turn2)]);
    for (let i = 0; i < n; i++) {
      assert.equal(firsts[i].text, firstsOff[i].text, `conversation ${i}, turn 1`);
      assert.equal(seconds[i].text, secondsOff[i].text, `conversation ${i}, turn 2`);
      assert.ok(cached(seconds[i]) >= firsts[i].usage.prompt_tokens - 1, `conversation ${i}: ${JSON.stringify(seconds[i].usage)}`);
      assert.equal(cached(secondsOff[i]), 0);
    }
    assert.ok(shared(await metrics(warm)) > shared(before), 'the conversations never shared a step');
  });

  it('/v1/completions reports the cached part of its prompt', async () => {
    const prompt = 'The quick brown fox jumps over the lazy dog while the build system links every target.';
    const complete = (p) => post(warm, '/v1/completions', { model: MODEL, prompt: p, max_tokens: 3 });
    const first = await complete(prompt);
    const again = await complete(prompt);
    assert.equal(again.usage.prompt_tokens_details.cached_tokens, first.usage.prompt_tokens - 1);
    assert.equal(again.choices[0].text, first.choices[0].text);
    assert.equal(first.usage.prompt_tokens_details.cached_tokens, 0);
  });
});

describe('prefix cache byte budgets', () => {
  let server;
  const DEVICE = 3 << 20;
  const HOST = 4 << 20;
  before(async () => {
    server = await startServer(['--cache-memory', '3MiB', '--cache-host-memory', '4MiB']);
  });
  after(async () => stopServer(server));

  it('keeps both tiers within their budgets, evicting least recently used snapshots', async () => {
    const conversations = Array.from({ length: 10 }, (_, i) =>
      [user(`Topic ${i}: explain how package ${i} is installed, configured and tested in a build.`)]);
    const answers = [];
    for (const messages of conversations) {
      answers.push(await ask(server, messages));
      const m = await metrics(server);
      assert.ok(m.get('lily_cache_bytes{tier="device"}') <= DEVICE);
      assert.ok(m.get('lily_cache_bytes{tier="host"}') <= HOST);
    }
    const m = await metrics(server);
    assert.equal(m.get('lily_cache_budget_bytes{tier="device"}'), DEVICE);
    assert.equal(m.get('lily_cache_budget_bytes{tier="host"}'), HOST);
    assert.ok(m.get('lily_cache_evictions_total{tier="device"}') > 0);
    assert.ok(m.get('lily_cache_evictions_total{tier="host"}') > 0);
    assert.ok(m.get('lily_cache_snapshots{tier="host"}') > 0);
    // The newest conversation is still cached; the oldest was dropped from both tiers.
    const last = conversations.length - 1;
    const next = await ask(server, [...conversations[last], assistant(answers[last].text), user('And then?')]);
    assert.ok(cached(next) >= answers[last].usage.prompt_tokens - 1, JSON.stringify(next.usage));
    const oldest = await ask(server, conversations[0]);
    assert.equal(cached(oldest), 0);
    assert.equal(oldest.text, answers[0].text);
  });
});
