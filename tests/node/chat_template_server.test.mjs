// `lily serve` renders the checkpoint's own chat template: a copy of the demo
// model whose chat_template.jinja is the Qwen3.5/3.6-style test template (it drops think blocks
// from history and raises on a conversation without a user query). The template's error is a 400
// with its message, the next turn's prompt extends the previous one (the prefix cache hits, which
// needs lily's history think blocks), and a template with an unsupported construct stops the
// start with the file and line. Run: LILY_BIN=build/lily node --test tests/node/chat_template_server.test.mjs
import { after, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

const source = process.env.LILY_SOURCE_DIR ?? path.resolve(import.meta.dirname, '..', '..');
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'lily-template-'));
const modelDir = path.join(tmp, 'demo');  // the harness serves the directory's name as the model
fs.cpSync(path.join(source, 'models', 'demo'), modelDir, { recursive: true });
const templateFile = path.join(modelDir, 'chat_template.jinja');
fs.copyFileSync(path.join(source, 'tests/fixtures/jinja/qwen3_6_tools.jinja'), templateFile);
process.env.LILY_TEST_MODEL_DIR = modelDir;
const { MODEL, chat, startServer, stopServer } = await import('./server_harness.mjs');

after(() => fs.rmSync(tmp, { recursive: true, force: true }));

describe('a checkpoint with its own template', () => {
  let server;
  before(async () => { server = await startServer(); });
  after(async () => { await stopServer(server); });

  it('is the template the server renders', () => {
    assert.match(server.log, new RegExp(`chat template: ${templateFile.replace(/[.*+?^${}()|[\]\\]/g, '\\$&')}`));
  });

  it('answers a template error with a 400 carrying its message', async () => {
    const res = await chat(server, { model: MODEL, messages: [{ role: 'user', content: '<tool_response>\nx\n</tool_response>' }], max_tokens: 2 });
    assert.equal(res.status, 400, res.body);
    assert.equal(res.json.error.param, 'messages');
    assert.match(res.json.error.message, /No user query found in messages\./);
  });

  it('renders the next turn as an extension of the previous one (prefix cache hit)', async () => {
    const first = [{ role: 'user', content: 'Name three colours.' }];
    const a = await chat(server, { model: MODEL, messages: first, max_tokens: 4 });
    assert.equal(a.status, 200, a.body);
    const answer = a.json.choices[0].message.content;
    const next = [...first, { role: 'assistant', content: answer }, { role: 'user', content: 'And three more?' }];
    const b = await chat(server, { model: MODEL, messages: next, max_tokens: 2 });
    assert.equal(b.status, 200, b.body);
    // At least the whole first prompt but its last token is reused: the history turn starts with
    // the same `<think>\n\n</think>\n\n` the generation prompt ended with.
    assert.ok(b.json.usage.prompt_tokens_details.cached_tokens >= a.json.usage.prompt_tokens - 1,
      `cached ${b.json.usage.prompt_tokens_details.cached_tokens} of first prompt ${a.json.usage.prompt_tokens}`);
  });
});

describe('a template with an unsupported construct', () => {
  it('stops the start with the file and line', async () => {
    fs.writeFileSync(templateFile, '{{ messages | length }}\n{% include "other.jinja" %}\n');
    await assert.rejects(startServer(), (e) => {
      assert.match(e.message, /exited early/);
      assert.match(e.message, /chat_template\.jinja: line 2: unsupported tag 'include'/);
      return true;
    });
  });
});
