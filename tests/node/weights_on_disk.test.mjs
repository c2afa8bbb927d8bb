// `lily serve --backend cpu` memory-maps model.safetensors; truncating that file
// while the server ran used to kill it with SIGBUS on the next request. Now the server refuses
// every request after such a change with a 503 that says what happened (and logs it once), keeps
// answering /health, and exits cleanly; with --no-mmap the weights are in memory and the same
// truncation changes nothing. A file replaced during a generation fails it at its next step.
// Each server runs on its own copy of the demo model.
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
    assert.match(server.log, / read into memory, /);
    fs.truncateSync(weights, 0);
    const second = await chat(server, ask);
    assert.equal(second.status, 200, second.body);
    assert.equal(second.json.choices[0].message.content, first.json.choices[0].message.content);
  });
});

describe('a weights file replaced while generations run', () => {
  let server;
  before(async () => { restore(); server = await startServer(); });
  after(async () => { await stopServer(server); restore(); });

  // The engine checks the files before every step, so a running generation fails at its next
  // token. The file is replaced by rename (a new inode): the old mapping stays readable, so the
  // test cannot fault even when the change lands inside a step.
  it('fails the running generations at their next step with 503 model_unavailable', async () => {
    const spare = `${weights}.new`;
    fs.writeFileSync(spare, original);
    const long = {
      model: MODEL, messages: [{ role: 'user', content: 'Tell me about CMake targets.' }], max_tokens: 400,
      logit_bias: { 8187: -100, 8189: -100 },  // the demo's stop tokens: it would run to max_tokens
    };
    const whole = chat(server, long);
    let replaced = false;
    let chunks = 0;
    const streamed = await chat(server, { ...long, stream: true }, {}, {
      timeoutMs: 60000,
      onData: (c) => {
        chunks += c.toString().split('data: ').length - 1;
        if (!replaced && chunks >= 3) {  // the role chunk and two tokens: both requests run
          fs.renameSync(spare, weights);
          replaced = true;
        }
      },
    });
    assert.ok(replaced, streamed.body);
    assert.equal(streamed.status, 200);
    const events = streamed.body.split('\n\n').map((l) => l.trim()).filter((l) => l.startsWith('data: {'))
      .map((l) => JSON.parse(l.slice(6)));
    const last = events.at(-1);
    assert.equal(last.error?.code, 'model_unavailable', streamed.body.slice(-1000));
    assert.match(last.error.message, /model\.safetensors was replaced by another file/);
    assert.ok(streamed.body.endsWith('data: [DONE]\n\n'));
    assert.ok(events.length < 100, `the stream ran on after the change: ${events.length} events`);
    assert.ok(events.every((e) => !e.choices?.[0]?.finish_reason), 'an error event, no finish_reason');
    const w = await whole;
    assert.equal(w.status, 503, w.body);
    assert.equal(w.json.error.code, 'model_unavailable');
    assert.equal(w.headers['retry-after'], undefined);
    assert.match(w.json.error.message, /restart lily serve/);
    assert.equal(server.exited, null, `the server died: ${server.log.slice(-2000)}`);
    assert.equal(server.log.match(/^lily: error: the model's weights changed on disk/gm)?.length, 1, server.log);
    assert.doesNotMatch(server.log, /request failed/, 'not logged as an internal error');
  });
});
