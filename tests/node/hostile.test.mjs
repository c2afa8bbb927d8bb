// Hostile and unusual HTTP clients against `lily serve`: a second server on a taken
// port, oversized and over-long request heads, bodies over --max-body (declared or chunked),
// slow-loris clients that trickle a head or a body, idle connections (new and kept-alive),
// Range headers, pipelining, half-closed clients, idle connections evicted at --max-connections
// (those mid-request kept), the 503 beyond --max-connections, an empty
// --api-key and an IPv4-mapped loopback bind. Loopback only; every loop is bounded in count and time.
// The timing assertions separate answering from blocked (and the eviction test bounds each
// /health at 2 s). The first: /health answers within
// HEALTH_LIMIT_MS (1 s) while 64 slow-loris connections are open; the 50 ms target is printed
// as a measurement (see the comment there).
// Run: LILY_BIN=build/lily node --test tests/node/hostile.test.mjs
import { after, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import {
  LILY_BIN, MODEL, MODEL_DIR, chat, connect, metrics, rawRequest, sleep, startServer, stopServer,
} from './server_harness.mjs';

const user = (content) => ({ role: 'user', content });

/**
 * Collects what the server sends on `sock` until it closes the connection (or resets it);
 * resolves {text, ms (from the call until the close), reset}. Rejects after `limitMs`.
 */
function untilClosed(sock, limitMs = 20000) {
  const t0 = Date.now();
  return new Promise((resolve, reject) => {
    let text = '';
    let reset = false;
    const timer = setTimeout(() => {
      sock.destroy();
      reject(new Error(`the connection is still open after ${limitMs} ms; received:\n${text.slice(0, 400)}`));
    }, limitMs);
    sock.on('data', (c) => { text += c.toString('latin1'); });
    sock.on('error', () => { reset = true; });
    sock.on('close', () => { clearTimeout(timer); resolve({ text, ms: Date.now() - t0, reset }); });
  });
}

/**
 * Parses consecutive HTTP/1.1 responses (Content-Length or chunked bodies) from `text`;
 * returns [{status, headers: [[name, value]...], body}] for the complete ones.
 */
function parseResponses(text) {
  const out = [];
  let at = 0;
  while (at < text.length) {
    const end = text.indexOf('\r\n\r\n', at);
    if (end < 0) break;
    const lines = text.slice(at, end).split('\r\n');
    const status = Number(lines[0].split(' ')[1]);
    const headers = lines.slice(1).map((l) => [l.slice(0, l.indexOf(':')).toLowerCase(), l.slice(l.indexOf(':') + 1).trim()]);
    const get = (name) => headers.find(([n]) => n === name)?.[1];
    let pos = end + 4;
    let body = '';
    if (status >= 100 && status < 200) {
      at = pos;
      continue;  // interim answers carry no body
    }
    if (get('transfer-encoding') === 'chunked') {
      while (true) {
        const lineEnd = text.indexOf('\r\n', pos);
        if (lineEnd < 0) return out;
        const size = parseInt(text.slice(pos, lineEnd), 16);
        if (size === 0) { pos = lineEnd + 4; break; }
        body += text.slice(lineEnd + 2, lineEnd + 2 + size);
        pos = lineEnd + 2 + size + 2;
      }
    } else {
      const len = Number(get('content-length') ?? 0);
      if (pos + len > text.length) break;
      body = text.slice(pos, pos + len);
      pos += len;
    }
    out.push({ status, headers, get, body });
    at = pos;
  }
  return out;
}

/** Writes `text` and waits until `count` whole responses arrived (or the connection closed). */
function exchange(sock, text, count = 1, limitMs = 20000) {
  return new Promise((resolve, reject) => {
    let received = '';
    const onData = (c) => {
      received += c.toString('latin1');
      if (parseResponses(received).length >= count) done();
    };
    const done = () => {
      clearTimeout(timer);
      sock.off('data', onData);
      sock.off('close', done);
      resolve(parseResponses(received));
    };
    const timer = setTimeout(() => reject(new Error(`no ${count} answers within ${limitMs} ms:\n${received.slice(0, 400)}`)), limitMs);
    sock.on('data', onData);
    sock.once('close', done);
    if (sock.listenerCount('error') === 0) sock.on('error', () => {});
    sock.write(text);
  });
}

/** Runs `lily ARGS` to its end (at most `limitMs`); resolves {code, stderr}. */
function runLily(args, env = {}, limitMs = 30000) {
  return new Promise((resolve, reject) => {
    const proc = spawn(LILY_BIN, args, { stdio: ['ignore', 'ignore', 'pipe'], env: { ...process.env, ...env } });
    let stderr = '';
    proc.stderr.on('data', (c) => { stderr += c.toString(); });
    const timer = setTimeout(() => { proc.kill('SIGKILL'); reject(new Error(`lily ${args.join(' ')} still runs:\n${stderr}`)); }, limitMs);
    proc.on('exit', (code) => { clearTimeout(timer); resolve({ code, stderr }); });
  });
}

/** Resident memory of a process in KiB (Linux /proc). */
const rssKiB = (pid) => Number(fs.readFileSync(`/proc/${pid}/status`, 'utf8').match(/VmRSS:\s+(\d+)/)[1]);

/**
 * Sends `count` GET /health requests one after another, `pauseMs` after each, asserting a 200
 * within 5 s for every one; resolves their round-trip times in ms. What the hostile clients
 * around them must not do is delay these answers.
 */
async function healthTimes(server, count, pauseMs = 0) {
  const times = [];
  for (let i = 0; i < count; i++) {
    const t0 = performance.now();
    const res = await rawRequest(server, 'GET', '/health', { timeoutMs: 5000 });
    times.push(performance.now() - t0);
    assert.equal(res.status, 200, res.body);
    if (pauseMs > 0) await sleep(pauseMs);
  }
  return times;
}

describe('start-up', () => {
  it('a second server on the same port fails with "address already in use", exit 1', async () => {
    const first = await startServer();
    try {
      const port = new URL(first.url).port;
      const second = await runLily(['serve', '--model', MODEL_DIR, '--backend', 'cpu', '--bind', `127.0.0.1:${port}`]);
      assert.equal(second.code, 1, second.stderr);
      assert.match(second.stderr, new RegExp(`cannot bind 127\\.0\\.0\\.1:${port}: address already in use`));
      // The first one still serves.
      assert.equal((await rawRequest(first, 'GET', '/health')).status, 200);
    } finally {
      await stopServer(first);
    }
  });

  it('--api-key "" and an empty LILY_API_KEY are errors, not "no authentication"', async () => {
    const flag = await runLily(['serve', '--model', MODEL_DIR, '--backend', 'cpu', '--bind', '127.0.0.1:0', '--api-key', '']);
    assert.equal(flag.code, 1, flag.stderr);
    assert.match(flag.stderr, /--api-key must not be empty/);
    assert.doesNotMatch(flag.stderr, /listening on/);
    const env = await runLily(['serve', '--model', MODEL_DIR, '--backend', 'cpu', '--bind', '127.0.0.1:0'], { LILY_API_KEY: '' });
    assert.equal(env.code, 1, env.stderr);
    assert.match(env.stderr, /LILY_API_KEY must not be empty/);
  });

  it('[::ffff:127.0.0.1] counts as loopback: no warning about a missing key', async () => {
    // --host overrides the harness's --bind host; the bracketed --bind form is unit-tested
    // (tests/unit/server/test_server_helpers.cpp).
    const server = await startServer(['--host', '::ffff:127.0.0.1']);
    try {
      assert.match(server.url, /^http:\/\/\[::ffff:127\.0\.0\.1\]:\d+$/);
      assert.doesNotMatch(server.log, /without an API key/);
      const port = new URL(server.url).port;
      assert.equal((await rawRequest({ url: `http://127.0.0.1:${port}` }, 'GET', '/health')).status, 200);
    } finally {
      await stopServer(server);
    }
  });
});

describe('request heads and bodies', () => {
  let server;
  before(async () => { server = await startServer(['--api-key', 'sesame', '--max-body', '1000']); });
  after(async () => stopServer(server));
  const auth = 'Authorization: Bearer sesame\r\n';

  it('a head over --max-header-bytes (default 16384) is 431 and closed, before auth', async () => {
    const sock = await connect(server);
    const closed = untilClosed(sock);
    sock.write(`GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Pad: ${'p'.repeat(17000)}\r\n\r\n`);
    const { text } = await closed;
    const [res] = parseResponses(text);
    assert.equal(res?.status, 431, text.slice(0, 300));
    assert.equal(JSON.parse(res.body).error.code, 'request_header_too_large');
    assert.equal(JSON.parse(res.body).error.message, 'request head exceeds the limit of 16384 bytes');
    assert.equal(res.get('connection'), 'close');
    // Just under the limit, with the key: served.
    const ok = await connect(server);
    const [fine] = await exchange(ok, `GET /v1/models HTTP/1.1\r\nHost: x\r\n${auth}X-Pad: ${'p'.repeat(15000)}\r\n\r\n`);
    assert.equal(fine.status, 200);
    ok.destroy();
  });

  it('more than --max-headers (default 100) header fields is 431', async () => {
    const fields = Array.from({ length: 101 }, (_, i) => `X-F${i}: v\r\n`).join('');
    const sock = await connect(server);
    const [res] = await exchange(sock, `GET /health HTTP/1.1\r\nHost: x\r\n${fields}\r\n`);
    assert.equal(res.status, 431);
    assert.equal(JSON.parse(res.body).error.code, 'request_header_too_large');
    assert.equal(JSON.parse(res.body).error.message, 'the request has more header fields than the limit of 100');
    sock.destroy();
  });

  it('a flood of huge heads is refused without growing the server\'s memory', async () => {
    const before = rssKiB(server.pid);
    // 32 connections at a time, 4 rounds, each sending 2 MiB of header bytes: 256 MiB in all.
    const chunk = Buffer.from(`X-Flood: ${'f'.repeat(65536)}\r\n`);
    for (let round = 0; round < 4; round++) {
      await Promise.all(Array.from({ length: 32 }, async () => {
        const sock = await connect(server);
        const closed = untilClosed(sock);
        sock.write('GET /health HTTP/1.1\r\nHost: x\r\n');
        for (let i = 0; i < 32 && !sock.destroyed; i++) {
          if (!sock.write(chunk)) await new Promise((r) => { sock.once('drain', r); sock.once('close', r); });
        }
        sock.end();
        const { text, reset } = await closed;
        // Either the 431 arrived, or the server's close overtook the rest of our flood (reset).
        assert.ok(/^HTTP\/1\.1 431 /.test(text) || reset, text.slice(0, 200));
      }));
    }
    const grown = rssKiB(server.pid) - before;
    assert.ok(grown < 32 * 1024, `RSS grew by ${grown} KiB`);
    assert.equal((await rawRequest(server, 'GET', '/health')).status, 200);
  });

  it('Content-Length: 10000000000 is 413 at once, without reading the body', async () => {
    const sock = await connect(server);
    const t0 = Date.now();
    const [res] = await exchange(sock, `POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n${auth}Content-Type: application/json\r\n` +
      'Content-Length: 10000000000\r\n\r\n{"model":', 1, 10000);
    assert.equal(res.status, 413);
    assert.equal(JSON.parse(res.body).error.code, 'request_too_large');
    assert.ok(Date.now() - t0 < 10000);
    sock.destroy();
  });

  it('a chunked body is refused with 413 as soon as it passes --max-body, not at its end', async () => {
    const sock = await connect(server);
    const closed = untilClosed(sock, 10000);
    sock.write(`POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n${auth}Content-Type: application/json\r\n` +
      'Transfer-Encoding: chunked\r\n\r\n');
    // Two chunks of 600 bytes pass the limit of 1000; the body is never finished.
    for (let i = 0; i < 2; i++) sock.write(`258\r\n${'a'.repeat(600)}\r\n`);
    const { text } = await closed;
    const [res] = parseResponses(text);
    assert.equal(res?.status, 413, text.slice(0, 300));
    assert.equal(JSON.parse(res.body).error.code, 'request_too_large');
  });

  it('Range headers are ignored: the whole answer, 200, no Content-Range', async () => {
    const res = await rawRequest(server, 'GET', '/v1/models', { headers: { Range: 'bytes=0-3', Authorization: 'Bearer sesame' } });
    assert.equal(res.status, 200);
    assert.equal(res.headers['content-range'], undefined);
    assert.equal(JSON.parse(res.body).data[0].id, MODEL);
    // 2,700 ranges "0-" once made /metrics a 9.9 MB multipart answer: now it is the plain text.
    const plain = await rawRequest(server, 'GET', '/metrics', { headers: { Authorization: 'Bearer sesame' } });
    const many = await rawRequest(server, 'GET', '/metrics', {
      headers: { Range: `bytes=${Array(2700).fill('0-').join(',')}`, Authorization: 'Bearer sesame' },
    });
    assert.equal(many.status, 200);
    assert.equal(many.headers['content-range'], undefined);
    assert.match(many.headers['content-type'], /^text\/plain/);
    assert.ok(many.raw.length < 2 * plain.raw.length, `${many.raw.length} bytes against ${plain.raw.length}`);
  });
});

describe('keep-alive, pipelining and half-closed clients', () => {
  let server;
  before(async () => { server = await startServer(['--keep-alive', '1']); });
  after(async () => stopServer(server));

  it('a Transfer-Encoding that does not end in chunked is refused and the connection closed: no smuggled request', async () => {
    const sock = await connect(server);
    const closed = untilClosed(sock);
    sock.write('POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n' +
               'GET /smuggled HTTP/1.1\r\nHost: x\r\n\r\n');
    const { text } = await closed;
    const res = parseResponses(text);
    assert.equal(res.length, 1, `expected one answer, got:\n${text.slice(0, 600)}`);
    assert.equal(res[0].status, 400);
    assert.match(JSON.parse(res[0].body).error.message, /Transfer-Encoding must end in 'chunked'/);
  });

  it('a transfer coding other than chunked before the chunked framing is a 501, not read as plain JSON', async () => {
    const sock = await connect(server);
    const closed = untilClosed(sock);
    const body = JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: 'hi' }], max_tokens: 1 });
    sock.write('POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n' +
               `Transfer-Encoding: gzip, chunked\r\n\r\n${body.length.toString(16)}\r\n${body}\r\n0\r\n\r\n`);
    const res = parseResponses((await closed).text);
    assert.equal(res.length, 1);
    assert.equal(res[0].status, 501);
    assert.match(JSON.parse(res[0].body).error.message, /unsupported transfer coding 'gzip'/);
  });

  it('an HTTP/1.1 request without exactly one Host is a 400, a compressed body a 415 (HTTP/1.0 needs no Host)', async () => {
    const answer = async (text) => {
      const sock = await connect(server);
      const closed = untilClosed(sock);
      sock.write(text);
      const res = parseResponses((await closed).text);
      sock.destroy();
      return res[0];
    };
    const noHost = await answer('GET /health HTTP/1.1\r\n\r\n');
    assert.equal(noHost.status, 400);
    assert.match(JSON.parse(noHost.body).error.message, /Host header/);
    assert.equal((await answer('GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n')).status, 400);
    const body = JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: 'hi' }], max_tokens: 1 });
    const gz = await answer('POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n' +
                            `Content-Encoding: gzip\r\nContent-Length: ${body.length}\r\n\r\n${body}`);
    assert.equal(gz.status, 415);
    assert.equal(JSON.parse(gz.body).error.code, 'unsupported_media_type');
    const old = await answer('GET /health HTTP/1.0\r\n\r\n');
    assert.equal(old.status, 200);
  });

  it('empty lines before a request line are skipped (a CRLF after a body), at most eight of them', async () => {
    const sock = await connect(server);
    const body = JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: 'hi' }], max_tokens: 1 });
    const post = 'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n' +
                 `Content-Length: ${body.length}\r\n\r\n${body}`;
    const res = await exchange(sock, `\r\n\n${post}\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n`, 2);
    assert.deepEqual(res.map((r) => r.status), [200, 200]);
    assert.equal(JSON.parse(res[0].body).object, 'chat.completion');
    assert.deepEqual(JSON.parse(res[1].body), { status: 'ok' });
    sock.destroy();
    const flood = await connect(server);
    const closed = untilClosed(flood);
    flood.write('\r\n'.repeat(9) + 'GET /health HTTP/1.1\r\nHost: x\r\n\r\n');
    const refused = parseResponses((await closed).text);
    assert.equal(refused[0].status, 400);
    flood.destroy();
  });

  it('three pipelined GETs in one write are answered in order', async () => {
    const sock = await connect(server);
    const get = (p) => `GET ${p} HTTP/1.1\r\nHost: x\r\n\r\n`;
    const res = await exchange(sock, get('/health') + get(`/v1/models/${MODEL}`) + get('/v1/models/nope'), 3);
    assert.deepEqual(res.map((r) => r.status), [200, 200, 404]);
    assert.deepEqual(JSON.parse(res[0].body), { status: 'ok' });
    assert.equal(JSON.parse(res[1].body).id, MODEL);
    assert.equal(JSON.parse(res[2].body).error.code, 'model_not_found');
    sock.destroy();
  });

  it('one connection serves 20 requests (no cap at 5)', async () => {
    const sock = await connect(server);
    for (let i = 0; i < 20; i++) {
      const [res] = await exchange(sock, 'GET /health HTTP/1.1\r\nHost: x\r\n\r\n');
      assert.equal(res?.status, 200, `request ${i + 1}`);
      assert.notEqual(res.get('connection'), 'close', `request ${i + 1}`);
    }
    assert.ok(!sock.destroyed);
    sock.destroy();
  });

  it('an idle keep-alive connection is closed after --keep-alive', async () => {
    const sock = await connect(server);
    const [res] = await exchange(sock, 'GET /health HTTP/1.1\r\nHost: x\r\n\r\n');
    assert.equal(res.status, 200);
    const { ms } = await untilClosed(sock, 10000);
    assert.ok(ms >= 500 && ms < 6000, `closed after ${ms} ms`);
  });

  it('a request followed at once by shutdown(SHUT_WR) still gets its answer', async () => {
    // GET
    const sock = await connect(server, { allowHalfOpen: true });
    const closed = untilClosed(sock);
    sock.end('GET /health HTTP/1.1\r\nHost: x\r\n\r\n');
    const [health] = parseResponses((await closed).text);
    assert.equal(health?.status, 200);
    // A whole chat answer equals the one a normal client gets; so does a streamed one.
    const body = { model: MODEL, messages: [user('Explain CMake presets.')], max_tokens: 24 };
    const normal = await chat(server, body);
    assert.equal(normal.status, 200, normal.body);
    for (const stream of [false, true]) {
      const payload = JSON.stringify({ ...body, stream });
      const half = await connect(server, { allowHalfOpen: true });
      const done = untilClosed(half);
      half.end(`POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n` +
        `Content-Length: ${Buffer.byteLength(payload)}\r\n\r\n${payload}`);
      const [res] = parseResponses((await done).text);
      assert.equal(res?.status, 200, `stream=${stream}`);
      if (!stream) {
        assert.equal(JSON.parse(res.body).choices[0].message.content, normal.json.choices[0].message.content);
      } else {
        const text = res.body.split('\n\n').filter((e) => e.startsWith('data: {'))
          .map((e) => JSON.parse(e.slice(6)).choices[0]?.delta?.content ?? '').join('');
        assert.equal(text, normal.json.choices[0].message.content);
        assert.match(res.body, /data: \[DONE\]/);
      }
    }
  });
});

describe('slow-loris and --max-connections', () => {
  it('trickled heads get 408 after --read-timeout for the whole head; /health keeps answering', async () => {
    const server = await startServer(['--read-timeout', '2', '--max-connections', '100']);
    try {
      // Each attacker sends one byte of a request head per second; the head never ends.
      const head = 'GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: ' + 'a'.repeat(40);
      const attackers = await Promise.all(Array.from({ length: 64 }, async () => {
        const sock = await connect(server);
        const result = untilClosed(sock, 15000);
        let i = 0;
        const timer = setInterval(() => {
          if (sock.destroyed || i >= head.length) return clearInterval(timer);
          sock.write(head[i++]);
        }, 1000);
        sock.write(head[i++]);
        return result.finally(() => clearInterval(timer));
      }));
      // While they are connected: /health, one request at a time, 10 times over about 1 s.
      // The target is 50 ms (printed below as a measurement: 1.3-1.9 ms on 2 loaded cores in
      // Release). The assertion only separates "answers" from "blocked": a server whose accept
      // loop waits on the trickling heads answers after seconds (5 s before this was fixed), and
      // a 50 ms bound flaked on a shared CI machine (127 ms once) without anything being wrong.
      const HEALTH_LIMIT_MS = 1000;
      const times = await healthTimes(server, 10, 100);
      const outcomes = await Promise.all(attackers);
      for (const { text, ms } of outcomes) {
        assert.match(text, /^HTTP\/1\.1 408 /, text.slice(0, 200));
        assert.match(text, /the request head did not arrive within the read timeout of 2 s/, text.slice(0, 400));
        assert.ok(ms >= 1500 && ms < 8000, `closed after ${ms} ms`);
      }
      console.log(`# /health under 64 slow-loris connections: max ${Math.max(...times).toFixed(1)} ms (target 50 ms)`);
      assert.ok(Math.max(...times) < HEALTH_LIMIT_MS, `/health took ${times.map((t) => t.toFixed(1)).join(', ')} ms`);
    } finally {
      await stopServer(server);
    }
  });

  it('a body trickled faster than any per-read time-out still gets 408 after --read-timeout in all', async () => {
    const server = await startServer(['--read-timeout', '2']);
    try {
      const sock = await connect(server);
      const closed = untilClosed(sock, 15000);
      sock.write('POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n' +
        'Content-Length: 100\r\n\r\n');
      // One byte every 250 ms: 25 s for the whole body, no gap longer than a read time-out.
      let sent = 0;
      const timer = setInterval(() => { if (!sock.destroyed && sent < 100) { sock.write('a'); sent++; } }, 250);
      const { text, ms } = await closed.finally(() => clearInterval(timer));
      const [res] = parseResponses(text);
      assert.equal(res?.status, 408, text.slice(0, 300));
      assert.equal(JSON.parse(res.body).error.code, 'request_timeout');
      assert.equal(JSON.parse(res.body).error.message, 'the request body did not arrive within the read timeout of 2 s');
      assert.match(res.get('x-request-id'), /^req_[0-9a-f]{16}$/);
      assert.ok(ms >= 1500 && ms < 8000, `closed after ${ms} ms`);
      assert.ok(sent < 40, `${sent} body bytes went in before the 408`);
    } finally {
      await stopServer(server);
    }
  });

  it('200 idle connections do not delay /health, and each is closed after --read-timeout', async () => {
    // cpp-httplib queued connections for a fixed thread pool: 2,000 idle ones delayed /health
    // by over 5 s. Here each admitted connection has its own thread; one that sends nothing is
    // closed without an answer once --read-timeout passes.
    const server = await startServer(['--read-timeout', '2', '--max-connections', '250']);
    try {
      const idle = await Promise.all(Array.from({ length: 200 }, () => connect(server)));
      const closed = idle.map((sock) => untilClosed(sock, 15000));
      await sleep(100);
      const times = await healthTimes(server, 5);
      console.log(`# /health beside 200 idle connections: max ${Math.max(...times).toFixed(1)} ms`);
      assert.ok(Math.max(...times) < 1000, `/health took ${times.map((t) => t.toFixed(1)).join(', ')} ms`);
      for (const { text, ms } of await Promise.all(closed)) {
        assert.equal(text, '', 'a connection that sent nothing gets no answer');
        assert.ok(ms >= 1000 && ms < 8000, `closed after ${ms} ms`);
      }
    } finally {
      await stopServer(server);
    }
  });

  it('at --max-connections the longest-idle connection is evicted for a new one; none mid-request is', async () => {
    // Before the eviction, --max-connections idle connections (sending nothing, or kept alive between
    // requests) used to lock every new client, /health included, out with 503s or resets until
    // --read-timeout (30 s here) passed. Now a new connection beyond the cap takes the slot of
    // the connection that has waited longest for a request head; one whose head is complete
    // (its body still coming) is never evicted.
    const CAP = 16;
    // --keep-alive 30: the kept-alive connection below can only be closed early by an eviction.
    const server = await startServer(['--max-connections', String(CAP), '--keep-alive', '30']);
    const socks = [];
    try {
      // The oldest: a kept-alive connection between requests (evictable), then two connections
      // in the middle of a request (head complete, body partly sent or not yet sent).
      const keptAlive = await connect(server);
      socks.push(keptAlive);
      const [first] = await exchange(keptAlive, 'GET /health HTTP/1.1\r\nHost: x\r\n\r\n');
      assert.equal(first.status, 200);
      const keptAliveClosed = untilClosed(keptAlive, 20000);
      const body = JSON.stringify({ prompt: 'hello world' });
      const busy = [];
      for (const sentFirst of [5, 0]) {
        const sock = await connect(server);
        socks.push(sock);
        sock.on('error', () => {});
        let text = '';
        sock.on('data', (c) => { text += c.toString('latin1'); });
        let closed = false;
        sock.on('close', () => { closed = true; });
        sock.write('POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n' +
          `Content-Length: ${body.length}\r\nConnection: close\r\n\r\n` + body.slice(0, sentFirst));
        busy.push({ sock, sentFirst, text: () => text, closed: () => closed });
      }
      await sleep(100);
      // CAP + 20 connections that send nothing: every slot taken, 20 (and more) evictions.
      const idle = [];
      for (let i = 0; i < CAP + 20; i++) {
        const sock = await connect(server);
        socks.push(sock);
        idle.push(untilClosed(sock, 20000));
      }
      await sleep(200);
      const times = await healthTimes(server, 5);
      console.log(`# /health beside ${CAP + 20} idle connections at --max-connections ${CAP}: ` +
        `${times.map((t) => t.toFixed(1)).join(', ')} ms`);
      assert.ok(Math.max(...times) < 2000, `/health took ${times.map((t) => t.toFixed(1)).join(', ')} ms`);
      // The kept-alive connection was the longest idle: closed, without another answer.
      const ka = await keptAliveClosed;
      assert.equal(ka.text, '', 'an evicted connection gets no answer');
      assert.ok(ka.ms < 10000, `the kept-alive connection was closed after ${ka.ms} ms`);
      // The connections mid-request were not evicted: their requests are served.
      for (const b of busy) {
        assert.equal(b.closed(), false, `a connection mid-request (${b.sentFirst} body bytes sent) was closed`);
        const [res] = await exchange(b.sock, body.slice(b.sentFirst));
        assert.equal(res?.status, 200, b.text().slice(0, 300));
        assert.ok(Array.isArray(JSON.parse(res.body).tokens));
      }
      // The evicted idle ones were closed at once (not after --read-timeout), without an answer.
      const evicted = await Promise.race([
        Promise.all(idle.slice(0, 20)),
        sleep(5000).then(() => { throw new Error('the 20 oldest idle connections are still open'); }),
      ]);
      for (const { text } of evicted) assert.equal(text, '', 'an evicted connection gets no answer');
      const m = await metrics(server);
      const count = m.get('lily_http_connections_evicted_total');
      // At least the kept-alive one and the 20 oldest idle ones (the probes may find a free slot).
      assert.ok(count >= 21, `lily_http_connections_evicted_total ${count}`);
      assert.match(server.log, /closed a connection idle for \d+ ms \(waiting for a request head\) to admit a new one \(connection limit \d+ reached\)/);
    } finally {
      for (const s of socks) s.destroy();
      await stopServer(server);
    }
  });

  it('the 503 beyond --max-connections has one "Connection: close" and no Keep-Alive header', async () => {
    const server = await startServer(['--max-connections', '1']);
    try {
      // The holder is mid-request (head complete, body not sent), so it cannot be evicted.
      const holder = await connect(server);
      holder.on('error', () => {});
      holder.write('POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 20\r\n\r\n');
      await sleep(200);
      const sock = await connect(server);
      const [res] = await exchange(sock, 'GET /health HTTP/1.1\r\nHost: x\r\n\r\n');
      assert.equal(res.status, 503);
      assert.deepEqual(res.headers.filter(([n]) => n === 'connection'), [['connection', 'close']]);
      assert.equal(res.get('keep-alive'), undefined);
      assert.equal(JSON.parse(res.body).error.code, 'too_many_connections');
      assert.equal(JSON.parse(res.body).error.message, 'too many open connections (limit 1); retry later');
      assert.match(res.get('x-request-id'), /^req_[0-9a-f]{16}$/, 'refusals carry a request id too');
      holder.destroy();
      sock.destroy();
    } finally {
      await stopServer(server);
    }
  });
});

describe('deeply nested JSON', () => {
  let server;
  before(async () => { server = await startServer(); });
  after(async () => stopServer(server));

  const post = async (route, text) => {
    const res = await rawRequest(server, 'POST', route, {
      body: text, headers: { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(text) },
    });
    return { status: res.status, json: JSON.parse(res.body) };
  };
  const nested = (n) => '['.repeat(n) + ']'.repeat(n);
  const toolsBody = (n) => `{"model":"${MODEL}","messages":[{"role":"user","content":"Hi"}],"tools":[{"type":"function",` +
    `"function":{"name":"a","parameters":{"type":"object","properties":{"x":{"enum":${nested(n)}}}}}}],"max_tokens":2}`;

  it('a tool schema nested 30,000 deep (60 KB) is a 400, on chat and /tokenize, and the server stays up', async () => {
    // It once overflowed the stack of the thread that rendered the chat template: a segfault.
    for (const route of ['/v1/chat/completions', '/tokenize']) {
      const res = await post(route, toolsBody(30000));
      assert.equal(res.status, 400, route);
      assert.equal(res.json.error.code, 'invalid_json', route);
      assert.match(res.json.error.message, /deeper than 128 levels/, route);
    }
    const args = '{"a":'.repeat(30000) + '1' + '}'.repeat(30000);
    const history = { model: MODEL, max_tokens: 2, messages: [
      { role: 'user', content: 'a' },
      { role: 'assistant', tool_calls: [{ id: 'c', type: 'function', function: { name: 'f', arguments: args } }] },
      { role: 'tool', tool_call_id: 'c', content: 'ok' }] };
    const res = await post('/v1/chat/completions', JSON.stringify(history));
    assert.equal(res.status, 400);
    assert.equal(res.json.error.param, 'messages[1].tool_calls[0].function.arguments');
    // A schema at depth 100 is served.
    const ok = await post('/v1/chat/completions', toolsBody(100));
    assert.equal(ok.status, 200, JSON.stringify(ok.json));
    assert.equal((await rawRequest(server, 'GET', '/health')).status, 200);
  });
});
