// `lily serve --backend cpu` memory-maps model.safetensors; truncating that file
// while the server ran used to kill it with SIGBUS on the next request. Now the server refuses
// every request after such a change with a 503 that says what happened (and logs it once), keeps
// answering /health, and exits cleanly; with --no-mmap the weights are in memory and the same
// truncation changes nothing. Each server runs on its own copy of the demo model.
// Run: LILY_BIN=build/lily node --test tests/node/weights_on_disk.test.mjs
import { after, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

const source = process.env.LILY_SOURCE_DIR ?? path.resolve(path.dirname(new URL(import.meta.url).pathname), '..', '..');
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'lily-weights-'));
const modelDir = path.join(tmp, 'demo');  // the harness serves the directory's name as the model
fs.cpSync(path.join(source, 'models', 'demo'), modelDir, { recursive: true });
process.env.LILY_TEST_MODEL_DIR = modelDir;
const { MODEL, chat, rawRequest, startServer, stopServer } = await import('./server_harness.mjs');

const ask = { model: MODEL, messages: [{ role: 'user', content: 'hello' }], max_tokens: 2 };
const weights = path.join(modelDir, 'model.safetensors');
const original = fs.readFileSync(weights);
const restore = () => fs.writeFileSync(weights, original);

after(() => fs.rmSync(tmp, { recursive: true, force: true }));

describe('a truncated model.safetensors under a memory-mapped server', () => {
  let server;
  before(async () => { restore(); server = await startServer(); });
  after(async () => { await stopServer(server); });

  it('answers before, refuses with 503 after, and stays up', async () => {
    const first = await chat(server, ask);
    assert.equal(first.status, 200, first.body);
    fs.truncateSync(weights, 4096);
    for (const body of [ask, { ...ask, stream: true }]) {
      const res = await chat(server, body);
      assert.equal(res.status, 503, res.body);
      assert.equal(res.json.error.type, 'server_error');
      assert.equal(res.json.error.code, 'model_unavailable');
      assert.equal(res.headers['retry-after'], undefined, 'waiting does not bring the weights back');
      assert.match(res.json.error.message, /changed on disk/);
      assert.match(res.json.error.message, /model\.safetensors was truncated from \d+ to 4096 bytes/);
      assert.match(res.json.error.message, /restart lily serve/);
    }
    assert.equal(server.exited, null, `the server died: ${server.log.slice(-2000)}`);
    const health = await rawRequest(server, 'GET', '/health');
    assert.equal(health.status, 200, health.body);
    // One log line for the operator, however many requests were refused.
    assert.equal(server.log.match(/^lily: error: the model's weights changed on disk/gm)?.length, 1, server.log);
  });
});

describe('--no-mmap', () => {
  let server;
  before(async () => { restore(); server = await startServer(['--no-mmap']); });
  after(async () => { await stopServer(server); restore(); });

  it('keeps answering the same after the file is truncated', async () => {
    const first = await chat(server, ask);
    assert.equal(first.status, 200, first.body);
    assert.match(server.log, /read into memory \(--no-mmap\)/);
    fs.truncateSync(weights, 0);
    const second = await chat(server, ask);
    assert.equal(second.status, 200, second.body);
    assert.equal(second.json.choices[0].message.content, first.json.choices[0].message.content);
  });
});
