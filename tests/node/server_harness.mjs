// Starts and stops real `lily serve` processes for the black-box server tests.
// LILY_BIN: the lily executable; LILY_SOURCE_DIR: the repository (for models/demo).
import { spawn } from 'node:child_process';
import http from 'node:http';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
export const SOURCE_DIR = process.env.LILY_SOURCE_DIR ?? path.resolve(here, '..', '..');
export const LILY_BIN = process.env.LILY_BIN ?? path.join(SOURCE_DIR, 'build', 'lily');
export const MODEL_DIR = process.env.LILY_TEST_MODEL_DIR ?? path.join(SOURCE_DIR, 'models', 'demo');
export const MODEL = path.basename(MODEL_DIR);

/** Starts `lily serve` on a free loopback port; resolves once it printed its URL. */
export async function startServer(extraArgs = [], env = {}) {
  const args = ['serve', '--model', MODEL_DIR, '--bind', '127.0.0.1:0', '--backend', 'cpu', ...extraArgs];
  const proc = spawn(LILY_BIN, args, { stdio: ['ignore', 'ignore', 'pipe'], env: { ...process.env, ...env } });
  const server = { proc, log: '', url: null, exited: null };
  server.exit = new Promise((resolve) => proc.on('exit', (code, signal) => {
    server.exited = { code, signal };
    resolve(server.exited);
  }));
  await new Promise((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`lily serve did not start:\n${server.log}`)), 60000);
    proc.stderr.on('data', (chunk) => {
      server.log += chunk.toString();
      const m = server.log.match(/serving \S+ on (http:\/\/[^\s]+)/);
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

/** Sends SIGTERM and waits for the exit; returns {code, signal}. */
export async function stopServer(server) {
  if (!server || server.exited) return server?.exited;
  server.proc.kill('SIGTERM');
  return server.exit;
}

/** One raw HTTP request; resolves {status, headers, body (string), raw (Buffer)}. */
export function rawRequest(server, method, urlPath, { body, headers = {} } = {}) {
  return new Promise((resolve, reject) => {
    const url = new URL(urlPath, server.url);
    const req = http.request(url, { method, headers, agent: false }, (res) => {
      const parts = [];
      res.on('data', (c) => parts.push(c));
      res.on('end', () => {
        const raw = Buffer.concat(parts);
        resolve({ status: res.statusCode, headers: res.headers, raw, body: raw.toString('utf8') });
      });
      res.on('error', reject);
    });
    req.on('error', reject);
    if (body !== undefined) req.write(body);
    req.end();
  });
}

/** POST /v1/chat/completions with a JSON (or raw string/Buffer) body; parses a JSON answer. */
export async function chat(server, body, headers = {}) {
  const payload = typeof body === 'string' || Buffer.isBuffer(body) ? body : JSON.stringify(body);
  const res = await rawRequest(server, 'POST', '/v1/chat/completions', {
    body: payload,
    headers: { 'Content-Type': 'application/json', 'Content-Length': Buffer.byteLength(payload), ...headers },
  });
  let json = null;
  try { json = JSON.parse(res.body); } catch { /* streams and empty bodies */ }
  return { ...res, json };
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

/** A user prompt of about `words` words, distinct per `seed` (defeats the prefix cache). */
export function longPrompt(seed, words = 600) {
  const vocab = ['cmake', 'target', 'library', 'python', 'file', 'module', 'install', 'package', 'build', 'path'];
  const out = [`Request ${seed}:`];
  for (let i = 0; i < words; i++) out.push(vocab[(i * 7 + seed * 13) % vocab.length]);
  return out.join(' ');
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
