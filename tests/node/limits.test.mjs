// Connection-level limits and start-up states of `lily serve`: the
// connection cap (--max-connections), /health with an API key (--health-requires-key), the
// warning for a non-loopback bind without a key, and the answers while the model is still
// loading. A client that stops reading (--write-timeout) is tested in C++
// (tests/unit/server/test_serve_slow_reader.cpp): it needs a small SO_RCVBUF, which Node cannot set.
// Run: LILY_BIN=build/lily node --test tests/node/limits.test.mjs
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import {
  MODEL, TEST_SERVER_BIN, chat, connect, metrics, rawRequest, sleep, startServer, stopServer,
} from './server_harness.mjs';

const user = (content) => ({ role: 'user', content });
const NON_LOOPBACK_WARNING = /lily: warning: binding to \S+ without an API key/;

/**
 * Sends `text` over `sock` and resolves everything received until the server closes; rejects
 * when the socket is closed already or stays open for `ms`.
 */
function exchange(sock, text, ms = 30000) {
  return new Promise((resolve, reject) => {
    if (sock.destroyed) return reject(new Error('the connection was closed before the request'));
    let received = '';
    const timer = setTimeout(() => reject(new Error(`the connection is still open after ${ms} ms:\n${received}`)), ms);
    sock.on('data', (c) => { received += c.toString('latin1'); });
    sock.on('error', () => {});
    sock.on('close', () => { clearTimeout(timer); resolve(received); });
    sock.write(text);
  });
}

describe('--max-connections', () => {
  it('answers a connection beyond the cap with 503 at once; admitted ones keep working', async () => {
    const server = await startServer(['--max-connections', '2']);
    try {
      // Two admitted connections, each in the middle of a request (head complete, body not
      // sent yet), so neither can be evicted for a new connection: a third is refused right
      // away, not queued until one of them leaves. (Connections still waiting for a head are
      // evicted instead: hostile.test.mjs.)
      const body = JSON.stringify({ prompt: 'hello' });
      const holders = [await connect(server), await connect(server)];
      for (const h of holders) {
        h.on('error', () => {});
        h.write('POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n' +
          `Content-Length: ${body.length}\r\nConnection: close\r\n\r\n`);
      }
      await sleep(200);
      const refused = await rawRequest(server, 'GET', '/health', { timeoutMs: 20000 });
      assert.equal(refused.status, 503, refused.body);
      assert.equal(refused.headers['retry-after'], '1');
      assert.match(refused.headers.connection ?? '', /close/);
      const err = JSON.parse(refused.body).error;
      assert.equal(err.code, 'too_many_connections');
      assert.equal(err.type, 'server_error');
      assert.equal(err.message, 'too many open connections (limit 2); retry later');
      // A refused keep-alive client is answered 503 and closed too.
      const keepAlive = await connect(server);
      const text = await exchange(keepAlive, 'GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n');
      assert.match(text, /^HTTP\/1\.1 503 /);
      assert.match(text, /too_many_connections/);
      // An admitted connection is served.
      const served = await exchange(holders[0], body);
      assert.match(served, /^HTTP\/1\.1 200 /);
      // Once it has left, a new connection is admitted (the server notices the close promptly).
      let status = 503;
      for (let i = 0; i < 100 && status === 503; i++) {
        status = (await rawRequest(server, 'GET', '/health')).status;
        if (status === 503) await sleep(50);
      }
      assert.equal(status, 200);
      holders[1].destroy();
    } finally {
      await stopServer(server);
    }
  });
});

describe('/health with an API key', () => {
  it('is open by default and needs the key with --health-requires-key', async () => {
    const [open, closedHealth, noKey] = await Promise.all([
      startServer(['--api-key', 'sesame']),
      startServer(['--api-key', 'sesame', '--health-requires-key']),
      startServer(['--health-requires-key']),
    ]);
    try {
      const auth = { Authorization: 'Bearer sesame' };
      assert.equal((await rawRequest(open, 'GET', '/health')).status, 200);
      assert.equal((await rawRequest(open, 'GET', '/v1/models')).status, 401);

      const denied = await rawRequest(closedHealth, 'GET', '/health');
      assert.equal(denied.status, 401);
      assert.equal(JSON.parse(denied.body).error.code, 'invalid_api_key');
      assert.equal(denied.headers['www-authenticate'], 'Bearer');
      const wrong = await rawRequest(closedHealth, 'GET', '/health', { headers: { Authorization: 'Bearer sesame2' } });
      assert.equal(wrong.status, 401);
      const ok = await rawRequest(closedHealth, 'GET', '/health', { headers: auth });
      assert.equal(ok.status, 200);
      assert.deepEqual(JSON.parse(ok.body), { status: 'ok' });

      // Without a key there is nothing to require.
      assert.equal((await rawRequest(noKey, 'GET', '/health')).status, 200);
    } finally {
      await Promise.all([stopServer(open), stopServer(closedHealth), stopServer(noKey)]);
    }
  });
});

describe('warning for a non-loopback bind', () => {
  it('is logged for 0.0.0.0 without a key, not with a key and not on loopback', async () => {
    const [exposed, keyed, loopback] = await Promise.all([
      startServer(['--host', '0.0.0.0']),
      startServer(['--host', '0.0.0.0', '--api-key', 'sesame']),
      startServer([]),
    ]);
    try {
      assert.match(exposed.url, /^http:\/\/0\.0\.0\.0:\d+$/);
      assert.match(exposed.log, NON_LOOPBACK_WARNING);
      assert.match(exposed.log, /binding to 0\.0\.0\.0 without an API key/);
      assert.doesNotMatch(keyed.log, NON_LOOPBACK_WARNING);
      assert.doesNotMatch(loopback.log, NON_LOOPBACK_WARNING);
      // The exposed server really serves (here reached through loopback).
      const port = new URL(exposed.url).port;
      const res = await rawRequest({ url: `http://127.0.0.1:${port}` }, 'GET', '/health');
      assert.equal(res.status, 200);
    } finally {
      await Promise.all([stopServer(exposed), stopServer(keyed), stopServer(loopback)]);
    }
  });
});

// The test server (TEST_SERVER_BIN) is `lily` with test hooks that hold a state long enough to
// be seen: LILY_TEST_LOAD_DELAY_MS holds the loader back, LILY_TEST_LISTEN_DELAY_MS the listener.
const delayed = { until: 'listening', bin: TEST_SERVER_BIN };

describe('while the model is loading', () => {
  it('answers /health and chat with 503 "loading", then serves', async () => {
    // The loader is held back; the server listens before it loads.
    const server = await startServer([], { LILY_TEST_LOAD_DELAY_MS: '5000' }, delayed);
    try {
      assert.doesNotMatch(server.log, /serving /);
      const health = await rawRequest(server, 'GET', '/health');
      assert.equal(health.status, 503);
      assert.deepEqual(JSON.parse(health.body), { status: 'loading' });
      assert.equal(health.headers['retry-after'], '1');
      const res = await chat(server, { model: MODEL, messages: [user('hi')], max_tokens: 1 });
      assert.equal(res.status, 503, res.body);
      assert.equal(res.json.error.code, 'server_not_ready');
      assert.equal(res.headers['retry-after'], '1');
      assert.equal((await metrics(server)).get('lily_model_ready'), 0);
      assert.equal((await rawRequest(server, 'GET', '/v1/models')).status, 200);

      for (let i = 0; i < 1200 && !/serving /.test(server.log); i++) await sleep(50);
      assert.match(server.log, /serving \S+ on http:/);
      assert.equal((await rawRequest(server, 'GET', '/health')).status, 200);
      assert.equal((await metrics(server)).get('lily_model_ready'), 1);
      const ok = await chat(server, { model: MODEL, messages: [user('hi')], max_tokens: 1 });
      assert.equal(ok.status, 200, ok.body);
    } finally {
      await stopServer(server);
    }
  });

  it('SIGTERM during loading exits 0', async () => {
    const server = await startServer([], { LILY_TEST_LOAD_DELAY_MS: '60000' }, delayed);
    assert.equal((await rawRequest(server, 'GET', '/health')).status, 503);
    await stopServer(server);  // throws unless the exit is clean
    assert.doesNotMatch(server.log, /serving /);
  });

  it('SIGTERM before the listener thread runs is not lost', async () => {
    // Regression: httplib's stop() does nothing until listen_after_bind() has begun, so a
    // signal (or a failed load) that came earlier was lost, and shutdown hung until the
    // watchdog's deadline. The listener thread is held back.
    const server = await startServer(['--shutdown-grace', '1'],
      { LILY_TEST_LISTEN_DELAY_MS: '1000', LILY_TEST_LOAD_DELAY_MS: '60000' }, delayed);
    await stopServer(server);  // throws unless the exit is clean
    assert.doesNotMatch(server.log, /shutdown deadline passed/);
    assert.match(server.log, /shutting down/);
  });

  it('lily serve itself has no test hooks: the delays are ignored', async () => {
    // With the hook a 60 s load delay would keep the model loading past the start timeout.
    const server = await startServer([], { LILY_TEST_LOAD_DELAY_MS: '60000', LILY_TEST_LISTEN_DELAY_MS: '60000' },
      { timeoutMs: 30000 });
    try {
      assert.equal((await rawRequest(server, 'GET', '/health')).status, 200);
    } finally {
      await stopServer(server);
    }
  });

  it('the test server refuses a delay that is not a whole number of milliseconds', async () => {
    await assert.rejects(startServer([], { LILY_TEST_LOAD_DELAY_MS: '5s' }, delayed),
      /LILY_TEST_LOAD_DELAY_MS must be a whole number of milliseconds/);
  });
});

describe('--max-tokens (the per-request completion cap)', () => {
  it('is the default max_tokens, and a larger request is a 400 naming max_tokens', async () => {
    const server = await startServer(['--max-tokens', '5']);
    try {
      // No max_tokens: at most 5 tokens (the demo model does not stop that early on this prompt).
      const omitted = await chat(server, { model: MODEL, messages: [user('Explain CMake presets in detail.')] });
      assert.equal(omitted.status, 200);
      assert.equal(omitted.json.usage.completion_tokens, 5);
      assert.equal(omitted.json.choices[0].finish_reason, 'length');
      // At the cap: served.
      const atCap = await chat(server, { model: MODEL, messages: [user('Hello')], max_tokens: 5 });
      assert.equal(atCap.status, 200);
      assert.ok(atCap.json.usage.completion_tokens <= 5);
      // Above it: refused before any work, in OpenAI's error shape.
      const over = await chat(server, { model: MODEL, messages: [user('Hello')], max_tokens: 6 });
      assert.equal(over.status, 400);
      assert.equal(over.json.error.type, 'invalid_request_error');
      assert.equal(over.json.error.param, 'max_tokens');
      assert.equal(over.json.error.code, 'max_tokens_exceeded');
      assert.match(over.json.error.message, /^max_tokens \(6\) exceeds this server's cap of 5 tokens$/);
      // min_tokens past the cap (no max_tokens): the message names the cap, not a flag.
      const minOver = await chat(server, { model: MODEL, messages: [user('Hello')], min_tokens: 6 });
      assert.equal(minOver.status, 400);
      assert.equal(minOver.json.error.param, 'min_tokens');
      assert.match(minOver.json.error.message,
        /^min_tokens \(6\) exceeds the 5 tokens this request may generate: this server's cap of 5 completion tokens$/);
    } finally {
      await stopServer(server);
    }
  });

  it('rejects a negative cap on the command line', async () => {
    await assert.rejects(startServer(['--max-tokens', '-1'], {}, { timeoutMs: 20000 }));
  });
});
