// Starts and stops real `lily serve` processes for the black-box server tests and the soak test.
// LILY_BIN: the lily executable (a sanitizer build works: see stopServer); LILY_SOURCE_DIR: the
// repository (for models/demo).
import { spawn } from 'node:child_process';
import http from 'node:http';
import net from 'node:net';
import path from 'node:path';
import { after, before } from 'node:test';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
export const SOURCE_DIR = process.env.LILY_SOURCE_DIR ?? path.resolve(here, '..', '..');
export const LILY_BIN = process.env.LILY_BIN ?? path.join(SOURCE_DIR, 'build', 'lily');
/**
 * tests/tools/lily_test_server: `lily` with the server's test hooks read from
 * LILY_TEST_LOAD_DELAY_MS and LILY_TEST_LISTEN_DELAY_MS (`lily` itself reads neither). Next to
 * LILY_BIN's build unless LILY_TEST_SERVER_BIN names it.
 */
export const TEST_SERVER_BIN = process.env.LILY_TEST_SERVER_BIN
  ?? path.join(process.env.LILY_BUILD_DIR ?? path.dirname(LILY_BIN), 'tests', 'lily_test_server');
export const MODEL_DIR = process.env.LILY_TEST_MODEL_DIR ?? path.join(SOURCE_DIR, 'models', 'demo');
export const MODEL = path.basename(MODEL_DIR);

/** Lines by which AddressSanitizer, LeakSanitizer and UBSan report a finding. */
export const SANITIZER_REPORT = /ERROR: (AddressSanitizer|LeakSanitizer)|runtime error: |SUMMARY: (Address|Undefined|Leak)/;

// A sanitizer report must end the server with a non-zero status even when the caller did not
// set these (the CTest run sets its own; ours only fill in what is missing).
const SANITIZER_ENV = {
  ASAN_OPTIONS: process.env.ASAN_OPTIONS ?? 'abort_on_error=1:detect_leaks=1',
  UBSAN_OPTIONS: process.env.UBSAN_OPTIONS ?? 'print_stacktrace=1:halt_on_error=1',
};

/**
 * Starts `lily serve --bind 127.0.0.1:0 --backend cpu` on the test model plus `extraArgs`.
 * Resolves once it printed its URL: by default the "serving NAME on URL" line (model loaded);
 * with `{ until: 'listening' }` already the earlier "listening on URL" line (model may be loading).
 * `bin` replaces LILY_BIN (the harness's own test uses a stand-in); `model` the checkpoint directory.
 * The server object: {proc, pid, args, log (stderr so far; its tail past 4 MB), url, exited, exit}.
 */
export async function startServer(extraArgs = [], env = {}, { until = 'serving', timeoutMs = 120000, bin = LILY_BIN, model = MODEL_DIR } = {}) {
  const args = ['serve', '--model', model, '--bind', '127.0.0.1:0', '--backend', 'cpu', ...extraArgs];
  const proc = spawn(bin, args, {
    stdio: ['ignore', 'ignore', 'pipe'], env: { ...process.env, ...SANITIZER_ENV, ...env },
  });
  const server = { proc, pid: proc.pid, args, log: '', url: null, exited: null };
  server.exit = new Promise((resolve) => proc.on('exit', (code, signal) => {
    server.exited = { code, signal, at: Date.now() };
    resolve(server.exited);
  }));
  // "serving NAME on URL (backend …)": NAME may hold spaces (--served-model-name).
  const pattern = until === 'listening' ? /listening on (http:\/\/[^\s;]+)/ : /serving .+ on (http:\/\/[^\s]+) \(/;
  await new Promise((resolve, reject) => {
    // A server that never gets there is killed: left running, it would keep the test process
    // (and so the whole suite) waiting on its pipe.
    const timer = setTimeout(() => {
      proc.kill('SIGKILL');
      reject(new Error(`lily serve did not start:\n${server.log}`));
    }, timeoutMs);
    proc.stderr.on('data', (chunk) => {
      server.log += chunk.toString();
      if (server.log.length > 4e6) server.log = server.log.slice(-1e6);  // keep the tail only
      const m = server.log.match(pattern);
      if (m && !server.url) {
        server.url = m[1];
        clearTimeout(timer);
        resolve();
      }
    });
    proc.on('exit', () => {
      clearTimeout(timer);
      if (!server.url) reject(new Error(`lily serve exited early:\n${server.log}`));
    });
  });
  return server;
}

/**
 * One server for the enclosing describe(): its `before` hook starts it (startServer(extraArgs,
 * env, options)) with an official `openai` client on it, its `after` hook stops it (stopServer,
 * so an unclean exit fails the suite). Returns {server, openai}, filled in once the hook ran:
 * read them in tests and later hooks, not while describe() runs. `apiKey`: the client's key.
 */
export function serverForSuite(extraArgs = [], { apiKey = 'unused', env = {}, ...options } = {}) {
  const suite = { server: null, openai: null };
  before(async () => {
    suite.server = await startServer(extraArgs, env, options);
    const { default: OpenAI } = await import('openai');  // only the suites that use it need the package
    suite.openai = new OpenAI({ baseURL: `${suite.server.url}/v1`, apiKey, maxRetries: 0 });
  });
  after(async () => { await stopServer(suite.server); });
  return suite;
}

/**
 * Throws unless the server exited with status 0 and its stderr holds no sanitizer report (under
 * ASan/UBSan a finding aborts the process or leaves a report; both fail the test here).
 */
export function assertCleanExit(server) {
  const report = server.log.match(SANITIZER_REPORT);
  if (report) {
    const at = server.log.indexOf(report[0]);
    throw new Error(`sanitizer report from lily serve:\n${server.log.slice(Math.max(0, at - 200), at + 4000)}`);
  }
  const { code, signal } = server.exited ?? {};
  if (code !== 0) throw new Error(`lily serve exited with ${JSON.stringify({ code, signal })}:\n${server.log.slice(-4000)}`);
}

/** Sends SIGTERM and waits for the exit; throws unless it was clean (assertCleanExit). */
export async function stopServer(server) {
  if (!server) return undefined;
  if (!server.exited) {
    server.proc.kill('SIGTERM');
    await server.exit;
  }
  await new Promise((r) => setImmediate(r));  // let the last stderr chunks arrive
  assertCleanExit(server);
  return server.exited;
}

/**
 * One raw HTTP request (a fresh connection); resolves {status, headers, body (string), raw (Buffer)}.
 * `timeoutMs`: reject with code 'hang' when no full answer came by then. `onData(chunk, req)`:
 * returning 'abort' closes the connection and resolves {status, headers, aborted: true}.
 */
export function rawRequest(server, method, urlPath, { body, headers = {}, timeoutMs = 0, onData } = {}) {
  return new Promise((resolve, reject) => {
    const url = new URL(urlPath, server.url);
    const req = http.request(url, { method, headers, agent: false });
    const timer = timeoutMs > 0 ? setTimeout(() => {
      req.destroy();
      reject(Object.assign(new Error(`no answer within ${timeoutMs} ms`), { code: 'hang' }));
    }, timeoutMs) : null;
    const finish = (fn, value) => { clearTimeout(timer); fn(value); };
    req.on('response', (res) => {
      const parts = [];
      res.on('data', (c) => {
        parts.push(c);
        if (onData && onData(c, req) === 'abort') {
          req.destroy();
          finish(resolve, { status: res.statusCode, headers: res.headers, aborted: true });
        }
      });
      res.on('end', () => {
        const raw = Buffer.concat(parts);
        finish(resolve, { status: res.statusCode, headers: res.headers, raw, body: raw.toString('utf8') });
      });
      res.on('error', (e) => finish(reject, e));
    });
    req.on('error', (e) => finish(reject, e));
    if (body !== undefined) req.write(body);
    req.end();
  });
}

/**
 * Opens a raw TCP connection to the server, for tests that write bytes an HTTP client would not;
 * resolves the connected socket, rejects with the socket's error (e.g. ECONNREFUSED).
 * `options` go to net.connect (e.g. allowHalfOpen).
 */
export function connect(server, options = {}) {
  const u = new URL(server.url);
  return new Promise((resolve, reject) => {
    const sock = net.connect({ port: Number(u.port), host: u.hostname, ...options }, () => resolve(sock));
    sock.once('error', reject);
  });
}

/** POST /v1/chat/completions with a JSON (or raw string/Buffer) body; parses a JSON answer. */
export async function chat(server, body, headers = {}, options = {}) {
  const payload = typeof body === 'string' || Buffer.isBuffer(body) ? body : JSON.stringify(body);
  const res = await rawRequest(server, 'POST', '/v1/chat/completions', {
    ...options,
    body: payload,
    headers: { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(payload), ...headers },
  });
  let json = null;
  try { json = JSON.parse(res.body); } catch { /* streams and empty bodies */ }
  return { ...res, json };
}

/** Parses an SSE body into {text, finish, usage, done ([DONE] seen), chunks}; throws on a non-data line. */
export function parseSse(body) {
  let text = '';
  let finish = null;
  let usage = null;
  let done = false;
  let chunks = 0;
  for (const event of body.split('\n\n')) {
    const line = event.trim();
    if (!line) continue;
    if (!line.startsWith('data: ')) throw new Error(`not an SSE data line: ${line.slice(0, 80)}`);
    const data = line.slice(6);
    if (data === '[DONE]') { done = true; continue; }
    const c = JSON.parse(data);
    chunks++;
    if (c.usage) usage = c.usage;
    const choice = c.choices?.[0];
    if (choice?.delta?.content) text += choice.delta.content;
    if (choice?.finish_reason) finish = choice.finish_reason;
  }
  return { text, finish, usage, done, chunks };
}

/** Reads /metrics and returns a map from series (name + labels) to value. */
export async function metrics(server, headers = {}) {
  const res = await rawRequest(server, 'GET', '/metrics', { headers });
  const out = new Map();
  for (const line of res.body.split('\n')) {
    if (!line || line.startsWith('#')) continue;
    const i = line.lastIndexOf(' ');
    out.set(line.slice(0, i), Number(line.slice(i + 1)));
  }
  return out;
}

/** Polls /metrics until `predicate(map)` holds; returns that map, or the last one after `timeoutMs`. */
export async function waitForMetrics(server, predicate, timeoutMs = 60000) {
  const deadline = Date.now() + timeoutMs;
  let m = await metrics(server);
  while (!predicate(m) && Date.now() < deadline) {
    await sleep(50);
    m = await metrics(server);
  }
  return m;
}

/** A user prompt of about `words` words, distinct per `seed` (defeats the prefix cache). */
export function longPrompt(seed, words = 600) {
  const vocab = ['cmake', 'target', 'library', 'python', 'file', 'module', 'install', 'package', 'build', 'path'];
  const out = [`Request ${seed}:`];
  for (let i = 0; i < words; i++) out.push(vocab[(i * 7 + seed * 13) % vocab.length]);
  return out.join(' ');
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/**
 * Joins a stream's chunks as a client does, choice by choice (by `index`): content,
 * reasoning_content and tool_calls (by their index), the finish reason, the choice's seed and
 * its logprobs entries. Resolves {message, finish} of choice 0, `choices` ([{message, finish,
 * seed, logprobs}] of every choice), `usage` (from the usage chunk, or null) and `chunks` (every
 * chunk as it came).
 */
export async function assembleStream(stream) {
  const chunks = [];
  const choices = [];
  let usage = null;
  for await (const chunk of stream) {
    chunks.push(chunk);
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices) {
      const into = (choices[choice.index] ??= {
        message: { content: '', reasoning_content: '', tool_calls: [] }, finish: null, seed: undefined, logprobs: [],
      });
      const { message } = into;
      const d = choice.delta ?? {};
      if (d.content) message.content += d.content;
      if (d.reasoning_content) message.reasoning_content += d.reasoning_content;
      for (const call of d.tool_calls ?? []) {
        const slot = (message.tool_calls[call.index] ??= { id: call.id, type: call.type, function: { name: '', arguments: '' } });
        if (call.function?.name) slot.function.name += call.function.name;
        if (call.function?.arguments) slot.function.arguments += call.function.arguments;
      }
      if (choice.finish_reason) into.finish = choice.finish_reason;
      if (choice.seed !== undefined) into.seed = choice.seed;
      if (choice.logprobs?.content) into.logprobs.push(...choice.logprobs.content);
    }
  }
  const first = choices[0] ?? { message: { content: '', reasoning_content: '', tool_calls: [] }, finish: null };
  return { message: first.message, finish: first.finish, choices, usage, chunks };
}

/** POSTs `body` as JSON to `route`; resolves {status, json} (the answer parsed as JSON). */
export async function postJson(server, route, body) {
  const payload = JSON.stringify(body);
  const res = await rawRequest(server, 'POST', route, {
    body: payload, headers: { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(payload) },
  });
  return { status: res.status, json: JSON.parse(res.body) };
}
