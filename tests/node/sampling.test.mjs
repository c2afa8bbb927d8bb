// Sampling, seeds, n and logprobs through the official OpenAI client against `lily serve` on
// the demo model: one server for the file (serverForSuite); the sampling defaults start servers
// of their own with the flags and generation_config.json under test.
// Run: LILY_BIN=build/lily node --test tests/node/sampling.test.mjs
import { after, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import OpenAI from 'openai';
import {
  LILY_BIN, MODEL, MODEL_DIR, SOURCE_DIR, assembleStream, chat, serverForSuite, startServer, stopServer,
} from './server_harness.mjs';

const golden = JSON.parse(fs.readFileSync(path.join(SOURCE_DIR, 'tests', 'fixtures', 'demo.golden.json'), 'utf8'));
const user = (content) => ({ role: 'user', content });
const client = (server) => new OpenAI({ baseURL: `${server.url}/v1`, apiKey: 'unused', maxRetries: 0 });
const messages = [user('Tell me a story about a dragon.')];

/** The seed of choice i of a request seeded with `seed` (docs/server.md): splitmix64, 53 bits. */
function choiceSeed(seed, i) {
  if (i === 0) return BigInt(seed);
  const M = (1n << 64n) - 1n;
  let z = (BigInt.asUintN(64, BigInt(seed)) + BigInt(i) * 0x9E3779B97F4A7C15n) & M;
  z = ((z ^ (z >> 30n)) * 0xBF58476D1CE4E5B9n) & M;
  z = ((z ^ (z >> 27n)) * 0x94D049BB133111EBn) & M;
  z ^= z >> 31n;
  return z & ((1n << 53n) - 1n);
}

describe('sampling on lily serve (demo model)', () => {
  const suite = serverForSuite();
  const ask = (extra) => suite.openai.chat.completions.create({ model: MODEL, messages, max_tokens: 24, ...extra });

  it('accepts the default request of chat front-ends (temperature 0.7, top_p 0.8)', async () => {
    const res = await ask({ temperature: 0.7, top_p: 0.8 });
    assert.equal(res.choices.length, 1);
    assert.equal(typeof res.choices[0].message.content, 'string');
    assert.ok(['stop', 'length'].includes(res.choices[0].finish_reason));
    assert.ok(res.usage.completion_tokens > 0);
    // Without a seed each request draws a fresh one, reported with the choice.
    assert.ok(Number.isSafeInteger(res.choices[0].seed) && res.choices[0].seed >= 0);
    const again = await ask({ temperature: 0.7, top_p: 0.8 });
    assert.notEqual(again.choices[0].seed, res.choices[0].seed);
  });

  it('a seeded request repeated gives the same text, also when its prompt comes from the cache', async () => {
    const first = await ask({ temperature: 1.0, seed: 42 });
    const second = await ask({ temperature: 1.0, seed: 42 });
    assert.equal(second.choices[0].message.content, first.choices[0].message.content);
    assert.ok(second.usage.prompt_tokens_details.cached_tokens > 0, 'the repeat hits the prefix cache');
    assert.equal(first.choices[0].seed, 42);
    // The reported fresh seed reproduces an unseeded answer.
    const free = await ask({ temperature: 1.5 });
    const replay = await ask({ temperature: 1.5, seed: free.choices[0].seed });
    assert.equal(replay.choices[0].message.content, free.choices[0].message.content);
  });

  it('different seeds give different texts at temperature 1.5', async () => {
    const texts = [];
    for (const seed of [1, 2, 3]) texts.push((await ask({ temperature: 1.5, seed })).choices[0].message.content);
    assert.equal(new Set(texts).size, 3, JSON.stringify(texts));
  });

  it('n: 3 gives 3 choices, each the single request with its derived seed; streamed alike', async () => {
    const res = await ask({ temperature: 1.5, seed: 7, n: 3 });
    assert.deepEqual(res.choices.map((c) => c.index), [0, 1, 2]);
    assert.equal(new Set(res.choices.map((c) => c.message.content)).size, 3);
    let completion = 0;
    for (const [i, choice] of res.choices.entries()) {
      assert.equal(BigInt(choice.seed), choiceSeed(7, i), `choice ${i} seed`);
      const single = await ask({ temperature: 1.5, seed: choice.seed });
      assert.equal(single.choices[0].message.content, choice.message.content, `choice ${i}`);
      assert.equal(single.choices[0].finish_reason, choice.finish_reason);
      completion += single.usage.completion_tokens;
    }
    assert.equal(res.usage.completion_tokens, completion);
    const streamed = await assembleStream(await ask({ temperature: 1.5, seed: 7, n: 3, stream: true,
      stream_options: { include_usage: true } }));
    assert.deepEqual(streamed.choices.map((c) => c.message.content), res.choices.map((c) => c.message.content));
    assert.deepEqual(streamed.choices.map((c) => c.seed), res.choices.map((c) => c.seed));
    assert.deepEqual(streamed.choices.map((c) => c.finish), res.choices.map((c) => c.finish_reason));
    assert.equal(streamed.usage.completion_tokens, completion);
  });

  it('logprobs: values ≤ 0, top entries sorted, streamed and whole answers agree', async () => {
    const body = { temperature: 1.0, seed: 11, logprobs: true, top_logprobs: 5 };
    const whole = await ask(body);
    const entries = whole.choices[0].logprobs.content;
    // One entry per generated token but a final stop token (which is not part of the text).
    const stopToken = whole.choices[0].finish_reason === 'stop' ? 1 : 0;
    assert.equal(entries.length, whole.usage.completion_tokens - stopToken);
    // The tokens' bytes spell the text (special tokens, never part of the text, aside).
    const special = (e) => /^<[^<>]+>$/.test(e.token);
    assert.equal(Buffer.concat(entries.filter((e) => !special(e)).map((e) => Buffer.from(e.bytes))).toString('utf8'),
      whole.choices[0].message.content);
    for (const e of entries) {
      assert.ok(e.logprob <= 0);
      assert.ok(Buffer.from(e.bytes).toString('utf8') === e.token || e.token.includes('\uFFFD'));
      assert.equal(e.top_logprobs.length, 5);
      for (let i = 1; i < 5; i++) assert.ok(e.top_logprobs[i - 1].logprob >= e.top_logprobs[i].logprob);
      for (const t of e.top_logprobs) assert.ok(t.logprob <= 0 && Array.isArray(t.bytes));
      // The chosen token is either in the top list with the same value, or less likely than all of it.
      const same = e.top_logprobs.find((t) => t.token === e.token);
      if (same) assert.ok(Math.abs(same.logprob - e.logprob) < 1e-6);
      else assert.ok(e.logprob <= e.top_logprobs[4].logprob);
    }
    const streamed = await assembleStream(await ask({ ...body, stream: true }));
    assert.equal(streamed.choices[0].message.content, whole.choices[0].message.content);
    assert.deepEqual(streamed.choices[0].logprobs, entries);
  });

  it('stop strings, streaming and max_tokens work with sampling', async () => {
    const free = await ask({ temperature: 1.2, seed: 21, max_tokens: 40 });
    const text = free.choices[0].message.content;
    const stop = text.slice(6, 8);  // two characters from inside the free answer
    assert.equal(stop.length, 2);
    const cut = await ask({ temperature: 1.2, seed: 21, max_tokens: 40, stop, logprobs: true });
    assert.equal(cut.choices[0].finish_reason, 'stop');
    assert.equal(cut.choices[0].message.content, text.slice(0, text.indexOf(stop)));
    const streamed = await assembleStream(await ask({ temperature: 1.2, seed: 21, max_tokens: 40, stop, stream: true,
      logprobs: true }));
    assert.equal(streamed.choices[0].message.content, cut.choices[0].message.content);
    assert.equal(streamed.choices[0].finish, 'stop');
    assert.deepEqual(streamed.choices[0].logprobs, cut.choices[0].logprobs.content);
    const short = await ask({ temperature: 1.2, seed: 21, max_tokens: 3 });
    assert.equal(short.usage.completion_tokens, 3);
    assert.ok(text.startsWith(short.choices[0].message.content));
  });

  it('greedy answers are unchanged, with or without logprobs; greedy picks the top entry', async () => {
    for (const g of golden.goldens.slice(0, 2)) {
      const plain = await suite.openai.chat.completions.create({ model: MODEL, messages: g.messages, max_tokens: 64 });
      assert.equal(plain.choices[0].message.content, g.text);
      const withLp = await suite.openai.chat.completions.create({ model: MODEL, messages: g.messages, max_tokens: 64,
        temperature: 0, logprobs: true, top_logprobs: 2 });
      assert.equal(withLp.choices[0].message.content, g.text);
      for (const e of withLp.choices[0].logprobs.content) assert.equal(e.top_logprobs[0].token, e.token);
    }
  });

  it('logit_bias steers the answer and is checked against the vocabulary', async () => {
    // Token 300 pushed by +100 is every greedy token.
    const res = await chat(suite.server, { model: MODEL, messages, max_tokens: 4, logit_bias: { 300: 100 }, logprobs: true });
    assert.equal(res.status, 200, res.body);
    const lps = res.json.choices[0].logprobs.content;
    assert.equal(lps.length, 4);
    assert.equal(new Set(lps.map((e) => e.token)).size, 1);
    const bad = await chat(suite.server, { model: MODEL, messages, max_tokens: 2, logit_bias: { 8192: 1 } });
    assert.equal(bad.status, 400);
    assert.equal(bad.json.error.param, 'logit_bias');
  });

  it('rejects every invalid sampling value with 400 naming the parameter', async () => {
    const base = { model: MODEL, messages: [user('hi')], max_tokens: 2 };
    const cases = [
      ['temperature', -1], ['temperature', 2.5], ['temperature', 'hot'], ['top_p', 0], ['top_p', 1.01],
      ['top_k', -5], ['top_k', 1.5], ['min_p', -0.5], ['min_p', 2], ['presence_penalty', 3],
      ['frequency_penalty', -2.5], ['repetition_penalty', 0], ['repetition_penalty', 3], ['seed', 0.5],
      ['seed', 'abc'], ['n', 0], ['n', 9], ['logprobs', 'yes'], ['top_logprobs', 21], ['top_logprobs', -1],
      ['logit_bias', []], ['logit_bias', { abc: 1 }], ['logit_bias', { 5: 200 }], ['logit_bias', { 99999: 1 }],
      ['logit_bias', Object.fromEntries(Array.from({ length: 301 }, (_, i) => [i, 1]))],
    ];
    for (const [param, value] of cases) {
      const body = { ...base, [param]: value };
      if (param === 'top_logprobs') body.logprobs = true;
      const res = await chat(suite.server, body);
      assert.equal(res.status, 400, `${param}=${JSON.stringify(value)} → ${res.status} ${res.body}`);
      assert.equal(res.json.error.type, 'invalid_request_error');
      assert.equal(res.json.error.param, param, `${param}=${JSON.stringify(value)}`);
    }
    const lonely = await chat(suite.server, { ...base, top_logprobs: 3 });
    assert.equal(lonely.status, 400);
    assert.equal(lonely.json.error.param, 'top_logprobs');
  });

  it('lily generate with the same seed gives the same text as the server', async () => {
    const res = await ask({ temperature: 1.5, seed: 99, max_tokens: 12 });
    const out = execFileSync(LILY_BIN, ['generate', '--model', MODEL_DIR, '--backend', 'cpu', '--prompt',
      messages[0].content, '--max-tokens', '12', '--temperature', '1.5', '--seed', '99', '--json', '--logprobs', '1'],
    { encoding: 'utf8', stdio: ['ignore', 'pipe', 'ignore'] });
    const doc = JSON.parse(out);
    assert.equal(doc.text, res.choices[0].message.content);
    assert.equal(doc.seed, 99);
    assert.ok(doc.logprobs.length > 0 && doc.logprobs.every((e) => e.logprob <= 0 && e.top_logprobs.length === 1));
  });

  describe('server sampling defaults', () => {
    let tmp;
    before(() => {
      tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'lily-sampling-'));
      for (const f of fs.readdirSync(MODEL_DIR)) fs.copyFileSync(path.join(MODEL_DIR, f), path.join(tmp, f));
      fs.writeFileSync(path.join(tmp, 'generation_config.json'),
        JSON.stringify({ do_sample: true, temperature: 1.5, top_k: 0, top_p: 1.0 }));
    });
    after(() => fs.rmSync(tmp, { recursive: true, force: true }));

    it('--temperature/--seed and generation_config.json give the defaults; request fields override', async () => {
      // Reference answers from the suite's server, which has no defaults.
      const reference = (await suite.openai.chat.completions.create({ model: MODEL, messages, max_tokens: 16,
        temperature: 1.5, seed: 5 })).choices[0].message.content;
      const greedy = (await suite.openai.chat.completions.create({ model: MODEL, messages, max_tokens: 16 }))
        .choices[0].message.content;
      assert.notEqual(reference, greedy);
      const flagged = await startServer(['--temperature', '1.5', '--seed', '5']);
      try {
        const res = await client(flagged).chat.completions.create({ model: MODEL, messages, max_tokens: 16 });
        assert.equal(res.choices[0].message.content, reference);
        const overridden = await client(flagged).chat.completions.create({ model: MODEL, messages, max_tokens: 16,
          temperature: 0 });
        assert.equal(overridden.choices[0].message.content, greedy);
      } finally {
        await stopServer(flagged);
      }
      const configured = await startServer(['--seed', '5'], {}, { model: tmp });
      try {
        const res = await client(configured).chat.completions.create({ model: path.basename(tmp), messages,
          max_tokens: 16 });
        assert.equal(res.choices[0].message.content, reference, 'generation_config.json do_sample + temperature 1.5');
      } finally {
        await stopServer(configured);
      }
    });

    it('refuses an out-of-range --temperature at start-up', async () => {
      await assert.rejects(startServer(['--temperature', '3']), /--temperature must be in/);
    });
  });
});
