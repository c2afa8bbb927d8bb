// Robustness checks of `lily serve` that the other black-box tests leave out: the context limit
// at exactly --max-seq, stalled clients (slow-loris) cut off by --read-timeout, oversized request
// heads, and the warning for a non-loopback bind without a key.
// Run: LILY_BIN=build/lily node --test tests/node/robustness.test.mjs
import { after, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import net from 'node:net';
import { MODEL, chat, parseSse, rawRequest, startServer, stopServer } from './server_harness.mjs';

const MAX_SEQ = 48;
const user = (content) => ({ role: 'user', content });
/** A user message of `n` repeated words (one token each after the first in the demo vocabulary). */
const words = (n) => Array.from({ length: n }, () => 'build').join(' ');

describe(`context limit at exactly --max-seq ${MAX_SEQ}`, () => {
  let server;
  let content;  // a message whose prompt leaves exactly `room` tokens
  let prompt;
  const room = 3;
  before(async () => {
    server = await startServer(['--max-seq', String(MAX_SEQ)]);
    // Grow the message until the prompt has MAX_SEQ - room tokens (each request asks for 1 token).
    for (let n = 1; n < MAX_SEQ; n++) {
      const res = await chat(server, { model: MODEL, messages: [user(words(n))], max_tokens: 1 });
      assert.equal(res.status, 200, res.body);
      if (res.json.usage.prompt_tokens === MAX_SEQ - room) {
        content = words(n);
        prompt = res.json.usage.prompt_tokens;
        break;
      }
      assert.ok(res.json.usage.prompt_tokens < MAX_SEQ - room, `no word count gives ${MAX_SEQ - room} prompt tokens`);
    }
    assert.ok(content, 'found the boundary prompt');
  });
  after(async () => stopServer(server));

  it('without max_tokens the answer fills the context and ends with "length"', async () => {
    const res = await chat(server, { model: MODEL, messages: [user(content)] });
    assert.equal(res.status, 200, res.body);
    assert.equal(res.json.usage.prompt_tokens, prompt);
    // Greedy decoding of the committed demo model does not stop within these few tokens, so the
    // answer is cut exactly at the limit.
    assert.equal(res.json.choices[0].finish_reason, 'length');
    assert.equal(res.json.usage.completion_tokens, room);
    assert.equal(res.json.usage.total_tokens, MAX_SEQ);
    // max_tokens equal to the room left is the same request; streamed, the same answer.
    const exact = await chat(server, { model: MODEL, messages: [user(content)], max_tokens: room });
    assert.equal(exact.status, 200, exact.body);
    assert.equal(exact.json.choices[0].message.content, res.json.choices[0].message.content);
    assert.equal(exact.json.choices[0].finish_reason, res.json.choices[0].finish_reason);
    const streamed = await chat(server, {
      model: MODEL, messages: [user(content)], stream: true, stream_options: { include_usage: true },
    });
    assert.equal(streamed.status, 200, streamed.body);
    const sse = parseSse(streamed.body);
    assert.equal(sse.text, res.json.choices[0].message.content);
    assert.equal(sse.finish, res.json.choices[0].finish_reason);
    assert.equal(sse.usage.completion_tokens, res.json.usage.completion_tokens);
    assert.ok(sse.done, 'the stream ends with [DONE]');
  });

  it('one token past the limit is a 400 naming max_tokens; the server keeps serving', async () => {
    const res = await chat(server, { model: MODEL, messages: [user(content)], max_tokens: room + 1 });
    assert.equal(res.status, 400, res.body);
    assert.equal(res.json.error.param, 'max_tokens');
    assert.equal(res.json.error.code, 'context_length_exceeded');
    const ok = await chat(server, { model: MODEL, messages: [user(content)], max_tokens: 1 });
    assert.equal(ok.status, 200, ok.body);
  });

  it('a prompt that fills the whole context is a 400; one token less gets exactly one token', async () => {
    let full = null;
    let oneLess = null;
    for (let n = 1; n < 2 * MAX_SEQ && !full; n++) {
      const res = await chat(server, { model: MODEL, messages: [user(words(n))], max_tokens: 1 });
      if (res.status === 200 && res.json.usage.prompt_tokens === MAX_SEQ - 1) oneLess = words(n);
      if (res.status === 400) {
        assert.equal(res.json.error.code, 'context_length_exceeded', res.body);
        full = words(n);
      }
    }
    assert.ok(full, 'some prompt length is rejected');
    // Each extra word is one more token, so the first rejected prompt has exactly MAX_SEQ tokens,
    // and the message says so.
    const noMax = await chat(server, { model: MODEL, messages: [user(full)] });
    assert.equal(noMax.status, 400, noMax.body);
    assert.equal(noMax.json.error.code, 'context_length_exceeded');
    assert.equal(noMax.json.error.type, 'invalid_request_error');
    assert.equal(noMax.json.error.param, 'messages');
    assert.match(noMax.json.error.message, new RegExp(`the prompt has ${MAX_SEQ} tokens but this server's maximum context length is ${MAX_SEQ} tokens, ` +
      'which leaves no room for a completion'));
    assert.ok(oneLess, `some prompt has exactly ${MAX_SEQ - 1} tokens`);
    const res = await chat(server, { model: MODEL, messages: [user(oneLess)] });
    assert.equal(res.status, 200, res.body);
    assert.equal(res.json.usage.prompt_tokens, MAX_SEQ - 1);
    assert.equal(res.json.usage.completion_tokens, 1);
    assert.equal(res.json.usage.total_tokens, MAX_SEQ);
    assert.equal(res.json.choices[0].finish_reason, 'length');
  });
});

describe('time-outs and request-head limits', () => {
  let server;
  before(async () => { server = await startServer(['--read-timeout', '2']); });
  after(async () => stopServer(server));

  /** Opens a socket, sends `text`, then stays silent; resolves ms until the server closes it. */
  const stall = (text) => new Promise((resolve, reject) => {
    const u = new URL(server.url);
    const t0 = Date.now();
    const sock = net.connect(Number(u.port), u.hostname, () => sock.write(text));
    const timer = setTimeout(() => { sock.destroy(); reject(new Error('the server kept a silent client for 30 s')); }, 30000);
    sock.on('error', () => {});
    sock.on('close', () => { clearTimeout(timer); resolve(Date.now() - t0); });
    sock.resume();
  });

  it('a client that stops mid-head (slow-loris) is disconnected after --read-timeout', async () => {
    const ms = await Promise.all([
      stall('POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty'),
      stall(''),
      stall('POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"model":'),
    ]);
    for (const t of ms) assert.ok(t >= 1500 && t < 15000, `closed after ${t} ms`);
    assert.equal((await rawRequest(server, 'GET', '/health')).status, 200);
  });

  it('an oversized request head is refused, not served, and the server stays up', async () => {
    let status = null;
    try {
      const res = await rawRequest(server, 'GET', '/health', { headers: { 'X-Padding': 'p'.repeat(1 << 17) } });
      status = res.status;
    } catch (e) {
      status = e.code;  // the server may close the connection instead of answering
    }
    assert.ok(status === 'ECONNRESET' || status === 'EPIPE' || (status >= 400 && status < 500), String(status));
    assert.equal((await rawRequest(server, 'GET', '/health')).status, 200);
  });
});
