// Tool calling and the thinking switch through the official `openai` client: a copy
// of the demo model whose chat_template.jinja is the Qwen3.5/3.6-style test template (it renders
// tools, tool calls and tool results). The tools reach the prompt, a tool result goes back in a
// `tool` message, the next turn's prompt extends the previous one token for token (the prefix
// cache hits), invalid agent fields are 400s naming the field, and streamed deltas assemble to
// the whole answer. (The demo model writes nonsense, never a tool call: calls parsed from model
// output are tested on a scripted model in tool_choice.test.mjs, and the parser itself in
// tests/unit/server/test_tool_calls.cpp.)
// Run: LILY_BIN=build/lily node --test tests/node/tools.test.mjs
import { after, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { spawnSync } from 'node:child_process';
import OpenAI from 'openai';

const source = process.env.LILY_SOURCE_DIR ?? path.resolve(import.meta.dirname, '..', '..');
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'lily-tools-'));
const modelDir = path.join(tmp, 'demo');
fs.cpSync(path.join(source, 'models', 'demo'), modelDir, { recursive: true });
fs.copyFileSync(path.join(source, 'tests/fixtures/jinja/qwen3_6_tools.jinja'), path.join(modelDir, 'chat_template.jinja'));
process.env.LILY_TEST_MODEL_DIR = modelDir;
const { LILY_BIN, MODEL, assembleStream: assemble, postJson: post, serverForSuite } = await import('./server_harness.mjs');

after(() => fs.rmSync(tmp, { recursive: true, force: true }));

const tools = [{
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'The weather of a city',
    parameters: { type: 'object', properties: { city: { type: 'string' }, days: { type: 'integer' } }, required: ['city'] },
  },
}];

async function promptOf(server, body) {
  const t = await post(server, '/tokenize', body);
  assert.equal(t.status, 200, JSON.stringify(t.json));
  const d = await post(server, '/detokenize', { tokens: t.json.tokens });
  return { tokens: t.json.tokens, text: d.json.prompt };
}

describe('tools and thinking', () => {
  const suite = serverForSuite();

  const question = [{ role: 'developer', content: 'Answer briefly.' }, { role: 'user', content: 'Weather in Paris?', name: 'ann' }];

  it('renders the declared tools into the prompt (and none with tool_choice "none")', async () => {
    const { text } = await promptOf(suite.server, { messages: question, tools });
    assert.match(text, /^<\|im_start\|>system\n# Tools\n/);
    assert.ok(text.includes('<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "The weather of a city", "parameters": {"type": "object"'), text);
    assert.ok(text.includes('\n\nAnswer briefly.<|im_end|>'), text);  // developer = system
    assert.ok(text.endsWith('<|im_start|>assistant\n<think>\n\n</think>\n\n'), text);
    const none = await promptOf(suite.server, { messages: question, tools, tool_choice: 'none' });
    assert.ok(!none.text.includes('<tools>'), none.text);
  });

  it('answers with tools declared, and takes the tool result back; the next prompt extends the last', async () => {
    const first = await suite.openai.chat.completions.create({ model: MODEL, messages: question, tools, tool_choice: 'auto', max_tokens: 4 });
    assert.equal(first.choices[0].message.role, 'assistant');
    assert.ok(['stop', 'length', 'tool_calls'].includes(first.choices[0].finish_reason));
    // The agent ran the tool the model (here: the test) asked for and sends the result back.
    const call = { id: 'call_1', type: 'function', function: { name: 'get_weather', arguments: '{"city": "Paris", "days": 2}' } };
    const next = [...question, { role: 'assistant', content: null, tool_calls: [call] },
      { role: 'tool', tool_call_id: 'call_1', content: '{"sky": "sunny"}' }];
    const before = await promptOf(suite.server, { messages: question, tools });
    const after = await promptOf(suite.server, { messages: next, tools });
    assert.ok(after.text.includes('<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n'), after.text);
    assert.ok(after.text.includes('<|im_start|>user\n<tool_response>\n{"sky": "sunny"}\n</tool_response><|im_end|>\n'), after.text);
    // Token for token, the first prompt (ending in the generation prompt) begins the next one.
    assert.deepEqual(after.tokens.slice(0, before.tokens.length), before.tokens);
    const second = await suite.openai.chat.completions.create({ model: MODEL, messages: next, tools, max_tokens: 2 });
    assert.equal(second.usage.prompt_tokens, after.tokens.length);
    assert.ok(second.usage.prompt_tokens_details.cached_tokens >= before.tokens.length - 1,
      `cached ${second.usage.prompt_tokens_details.cached_tokens} of ${before.tokens.length}`);
  });

  it('streams deltas that assemble to the whole answer', async () => {
    const body = { model: MODEL, messages: question, tools, max_tokens: 12 };
    const whole = await suite.openai.chat.completions.create(body);
    const { message, finish } = await assemble(await suite.openai.chat.completions.create({ ...body, stream: true }));
    assert.equal(message.content, whole.choices[0].message.content ?? '');
    assert.deepEqual(message.tool_calls.map((c) => c.function), (whole.choices[0].message.tool_calls ?? []).map((c) => c.function));
    assert.equal(finish, whole.choices[0].finish_reason);
  });

  it('thinks when asked: reasoning_content, whole and streamed', async () => {
    const { text } = await promptOf(suite.server, { messages: question, chat_template_kwargs: { enable_thinking: true } });
    assert.ok(text.endsWith('<|im_start|>assistant\n<think>\n'), text);
    const body = { model: MODEL, messages: question, reasoning_effort: 'high', max_tokens: 12 };
    const whole = await suite.openai.chat.completions.create(body);
    const m = whole.choices[0].message;
    assert.equal(typeof m.reasoning_content, 'string');
    assert.ok(m.reasoning_content.length + m.content.length > 0);
    const { message } = await assemble(await suite.openai.chat.completions.create({ ...body, stream: true }));
    assert.equal(message.reasoning_content, m.reasoning_content);
    assert.equal(message.content, m.content);
    // Off by default, and reasoning_effort "none" keeps it off.
    const plain = await suite.openai.chat.completions.create({ model: MODEL, messages: question, reasoning_effort: 'none', max_tokens: 2 });
    assert.equal(plain.choices[0].message.reasoning_content, undefined);
  });

  it('a </think> the tokenizer marks special still ends the reasoning (the demo tokenizer does)', async () => {
    // logit_bias forces the demo's </think> (id 8191, special there) at every step: the first
    // ends the empty reasoning and the second is content, whole and streamed alike.
    const body = { model: MODEL, messages: question, reasoning_effort: 'high', max_tokens: 2, logit_bias: { 8191: 100 } };
    const whole = await suite.openai.chat.completions.create(body);
    const m = whole.choices[0].message;
    assert.equal(m.reasoning_content ?? '', '');
    assert.equal(m.content, '</think>');
    const { message } = await assemble(await suite.openai.chat.completions.create({ ...body, stream: true }));
    assert.equal(message.content, '</think>');
  });

  it('refuses invalid agent fields with a 400 naming the field', async () => {
    const cases = [
      [{ tools, tool_choice: { type: 'function', function: { name: 'get_time' } } }, 'tool_choice.function.name'],
      [{ tool_choice: 'required' }, 'tool_choice'],
      [{ tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'string' } } }] }, 'tools[0].function.parameters.type'],
      [{ tools: [{ type: 'function', function: { name: 'f', parameters: [] } }] }, 'tools[0].function.parameters'],
      [{ tools: [{ type: 'code_interpreter' }] }, 'tools[0].type'],
      [{ messages: [...question, { role: 'tool', content: 'x' }] }, 'messages[2].tool_call_id'],
      [{ chat_template_kwargs: { enable_thinking: 'yes' } }, 'chat_template_kwargs.enable_thinking'],
      [{ parallel_tool_calls: 1 }, 'parallel_tool_calls'],
    ];
    for (const [extra, param] of cases) {
      await assert.rejects(suite.openai.chat.completions.create({ model: MODEL, messages: question, max_tokens: 2, ...extra }), (e) => {
        assert.ok(e instanceof OpenAI.BadRequestError, String(e));
        assert.equal(e.param, param, JSON.stringify(extra));
        return true;
      });
    }
  });
});

describe('lily tokenize --render-messages --chat-options', () => {
  const messages = [{ role: 'user', content: 'q' },
    { role: 'assistant', content: null, tool_calls: [{ id: 'c', type: 'function', function: { name: 'get_weather', arguments: '{"city":"Rome"}' } }] },
    { role: 'tool', tool_call_id: 'c', content: 'rain' }];
  const run = (options) => spawnSync(LILY_BIN, ['tokenize', '--model', modelDir, '--render-messages', JSON.stringify(messages),
    '--chat-options', JSON.stringify(options)], { encoding: 'utf8' });

  it('renders tools, tool calls, tool results and thinking as the server does', () => {
    const r = run({ tools, chat_template_kwargs: { enable_thinking: true } });
    assert.equal(r.status, 0, r.stderr);
    assert.ok(r.stdout.includes('"name": "get_weather"'), r.stdout);
    assert.ok(r.stdout.includes('<function=get_weather>\n<parameter=city>\nRome\n</parameter>'), r.stdout);
    assert.ok(r.stdout.includes('<tool_response>\nrain\n</tool_response>'), r.stdout);
    assert.ok(r.stdout.endsWith('<|im_start|>assistant\n<think>\n'), r.stdout);
  });

  it('refuses invalid options naming the field', () => {
    const r = run({ tools: [{ type: 'function', function: { name: 'f', parameters: { type: 'array' } } }] });
    assert.equal(r.status, 1);
    assert.match(r.stderr, /--chat-options: 'tools\[0\]\.function\.parameters\.type' must be "object"/);
  });
});
