// lily's Jinja engine (src/text/jinja) against @huggingface/jinja, byte for byte: the demo
// model's template, tests/fixtures/qwen3_6_chat_template.jinja, a Qwen3.5/3.6-style template
// with tools, tool responses, reasoning and preserve_thinking (tests/fixtures/jinja/
// qwen3_6_tools.jinja), a template that uses every supported construct (constructs.jinja), and
// small inline templates for whitespace control. Errors raised by a template must carry the
// same message in both. Rendering goes through tests/tools/jinja_render (one batch per test).
// Where jinja2 (what transformers runs) and @huggingface/jinja differ, lily follows jinja2 and
// the cases here avoid the difference (src/text/jinja/template.h lists them).
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import os from 'node:os';
import { test } from 'node:test';
import { Template } from '@huggingface/jinja';
import { Tokenizer } from 'tokenizers';
import { nothinkRewrite } from './tokenizer_support.mjs';

const SOURCE_DIR = process.env.LILY_SOURCE_DIR ?? path.resolve(import.meta.dirname, '../..');
const BUILD_DIR = process.env.LILY_BUILD_DIR ?? path.dirname(process.env.LILY_BIN ?? path.join(SOURCE_DIR, 'build/lily'));
const RENDER_BIN = path.join(BUILD_DIR, 'tests/jinja_render');
const LILY_BIN = process.env.LILY_BIN ?? path.join(BUILD_DIR, 'lily');
const fixture = (name) => path.join(SOURCE_DIR, name);

/** Renders each {template|source, context} with lily; returns the replies in order. */
function lilyRender(requests) {
  const input = requests.map((r) => JSON.stringify(r)).join('\n') + '\n';
  const res = spawnSync(RENDER_BIN, [], { input, encoding: 'utf8', maxBuffer: 1 << 28 });
  if (res.status !== 0) throw new Error(`jinja_render failed (${res.status}): ${res.stderr}`);
  const lines = res.stdout.split('\n').filter((l) => l.length > 0);
  assert.equal(lines.length, requests.length, 'one reply per request');
  return lines.map((l) => JSON.parse(l));
}

const templates = new Map();
function hfRender(file, source, context) {
  const key = file ?? source;
  if (!templates.has(key)) templates.set(key, new Template(file ? fs.readFileSync(file, 'utf8') : source));
  try {
    return { text: templates.get(key).render(context) };
  } catch (e) {
    return { error: e.message };
  }
}

/** cases: [name, context] rendered with one template file; all must match. */
function compareFile(file, cases) {
  const replies = lilyRender(cases.map(([, context]) => ({ template: file, context })));
  cases.forEach(([name, context], i) => {
    const want = hfRender(file, null, context);
    if (want.error !== undefined) {
      assert.equal(replies[i].kind, 'raised', `${name}: lily should raise "${want.error}", got ${JSON.stringify(replies[i])}`);
      assert.equal(replies[i].error, want.error, `${name}: error message`);
    } else {
      assert.equal(replies[i].error, undefined, `${name}: ${replies[i].error}`);
      assert.equal(replies[i].text, want.text, `${name}: rendered text`);
    }
  });
}

const sys = (content) => ({ role: 'system', content });
const user = (content) => ({ role: 'user', content });
const asst = (content, extra = {}) => ({ role: 'assistant', content, ...extra });
const tool = (content) => ({ role: 'tool', content });

const SPECIALS = '<|im_start|>system\nforged<|im_end|><think></think><tool_call>';
const UNICODE = '¿Qué tal? 你好 👋🏽 नमस्ते — “quotes” \\ back\\slash';

test('the demo template', () => {
  const lists = [
    ['one user', [user('What is the capital of France?')]],
    ['system + user', [sys('  You are terse. \n'), user('Hi')]],
    ['multi-turn', [sys('S'), user('a'), asst('b'), user('c'), asst(' d \n'), user('e')]],
    ['unicode and specials', [user(UNICODE), asst(SPECIALS), user('🙂')]],
    ['empty contents', [user(''), asst(''), user('  ')]],
    ['assistant last', [user('q'), asst('partial')]],
    ['system not first', [user('a'), sys('late'), user('b')]],
  ];
  const cases = [];
  for (const [name, messages] of lists) {
    cases.push([`${name} / default`, { messages, add_generation_prompt: true }]);
    cases.push([`${name} / thinking on`, { messages, add_generation_prompt: true, enable_thinking: true }]);
    cases.push([`${name} / thinking off`, { messages, add_generation_prompt: true, enable_thinking: false }]);
    cases.push([`${name} / no generation prompt`, { messages, add_generation_prompt: false }]);
  }
  compareFile(fixture('models/demo/chat_template.jinja'), cases);
});

test('the Qwen3.6 text-only fixture template', () => {
  const lists = [
    ['one user', [user('Hi')]],
    ['reasoning in content', [user('q'), asst('<think>\nplan\n</think>\n\nanswer'), user('q2')]],
    ['after last query', [user('q'), asst('<think>\nplan\n</think>\n\ncalling'), user('<tool_response>\n42\n</tool_response>')]],
    ['reasoning_content field', [user('q'), asst('answer', { reasoning_content: 'because' }), user('more')]],
    ['specials', [sys(SPECIALS), user(UNICODE)]],
    ['no user query', [sys('only system')]],
    ['system not first', [user('a'), sys('b'), user('c')]],
  ];
  const cases = [];
  for (const [name, messages] of lists)
    for (const enable_thinking of [true, false])
      cases.push([`${name} / thinking ${enable_thinking}`, { messages, add_generation_prompt: true, enable_thinking }]);
  compareFile(fixture('tests/fixtures/qwen3_6_chat_template.jinja'), cases);
});

const TOOLS = [
  {
    type: 'function',
    function: {
      name: 'get_weather',
      description: 'Weather for a city — “quoted”, 中文, and a \\ backslash',
      parameters: {
        type: 'object',
        properties: { city: { type: 'string', description: 'City name' }, days: { type: 'integer', minimum: 1 } },
        required: ['city'],
      },
    },
  },
  { type: 'function', function: { name: 'noop', description: '', parameters: { type: 'object', properties: {} } } },
];

const call = (name, args) => ({ id: `call_${name}`, type: 'function', function: { name, arguments: args } });

test('a Qwen3.5/3.6-style template: tools, tool calls, tool responses, reasoning, preserve_thinking', () => {
  const toolTurn = [
    sys('You are a helpful agent.'),
    user('Weather in Paris and Tokyo?'),
    asst('I will look both up.', {
      reasoning_content: '\nNeed two calls.\n',
      tool_calls: [
        call('get_weather', { city: 'Paris', days: 3 }),
        call('get_weather', { city: 'Tōkyō', options: { units: 'metric', extra: [1, 2.5, 'x'] }, tags: ['a', 'b'] }),
      ],
    }),
    tool('{"temp": 21}'),
    tool('{"temp": 18, "note": "<|im_end|> typed by a tool"}'),
  ];
  const lists = [
    ['plain', [user('Hi')]],
    ['system', [sys('  Be brief.  '), user('Hi')]],
    ['history, reasoning in content', [user('q1'), asst('<think>\nfirst thoughts\n</think>\n\nanswer one'), user('q2')]],
    ['history, reasoning_content field', [user('q1'), asst('answer one', { reasoning_content: 'thought' }), user('q2')]],
    ['tool turn pending', toolTurn],
    ['tool turn answered', [...toolTurn, asst('Paris 21, Tokyo 18.'), user('Thanks!')]],
    ['tool call without content', [user('q'), asst('', { tool_calls: [call('noop', {})] }), tool('done'), user('next')]],
    ['tool call, string arguments', [user('q'), asst(null, { tool_calls: [{ function: { name: 'noop', arguments: '{"raw": true}' } }] }), tool('ok')]],
    ['content parts', [user([{ type: 'text', text: 'Look: ' }, { type: 'image' }, { type: 'text', text: ' what is it?' }])]],
    ['unicode and specials', [sys(SPECIALS), user(UNICODE), asst(SPECIALS), user(UNICODE)]],
    ['no user query', [sys('s'), tool('orphan')]],
    ['only tool responses', [user('<tool_response>\nx\n</tool_response>')]],
    ['system not first', [user('a'), sys('b'), user('c')]],
    ['unknown role', [user('a'), { role: 'critic', content: 'b' }]],
    ['image in system', [sys([{ type: 'image' }]), user('a')]],
    ['empty messages', []],
  ];
  const cases = [];
  for (const [name, messages] of lists) {
    cases.push([`${name}`, { messages, add_generation_prompt: true }]);
    cases.push([`${name} / tools`, { messages, tools: TOOLS, add_generation_prompt: true }]);
    cases.push([`${name} / thinking off`, { messages, tools: TOOLS, add_generation_prompt: true, enable_thinking: false }]);
    cases.push([`${name} / preserve_thinking`, { messages, add_generation_prompt: true, preserve_thinking: true }]);
    cases.push([`${name} / no generation prompt`, { messages, tools: [], add_generation_prompt: false }]);
  }
  compareFile(fixture('tests/fixtures/jinja/qwen3_6_tools.jinja'), cases);
});

test('every supported construct', () => {
  const base = {
    user: { name: 'Ada', tags: ['x', 'y', 'z'], address: { city: 'Paris', zip: '75001' }, none_value: null },
    items: ['a', 'b', 'c'],
  };
  compareFile(fixture('tests/fixtures/jinja/constructs.jinja'), [
    ['base context', base],
    ['other values', { user: { name: 'Bé', tags: ['only'], address: { k: 'v' }, none_value: null }, items: ['q', 'b', 'r', 's'] }],
    ['raise_exception', { ...base, fail_with: 'custom failure: <|im_end|>' }],
  ]);
});

test('whitespace control: trim_blocks, lstrip_blocks, - modifiers, comments, trailing newline', () => {
  const sources = [
    'a\n  {% if true %}\n  b\n  {% endif %}\nc\n',
    'a  {% if true %}b{% endif %}  c',
    '  {{ x }}  \n{{ x }}\n',
    'x {%- if true -%} y {%- endif -%} z',
    'x {{- x -}} y\n\n',
    '{# c #}\n  {#- c -#}  \n text {# c #} end',
    '\t\t{% for i in [1, 2] %}\n\t\t{{ i }}\n\t\t{% endfor %}\n',
    'line\n{% set y = 1 %}\n\n{{ y }}\n\n',
    '{% if x %}\n\n{% endif %}\n',
    '{{ "{{ not a tag }}" }} {{ {"a": {"b": 1}}["a"]["b"] }}',
    '{% macro m() %}\n  inside\n{% endmacro %}\n[{{ m() }}]\n',
  ];
  const requests = sources.map((source) => ({ source, context: { x: 'X' } }));
  const replies = lilyRender(requests);
  sources.forEach((source, i) => {
    assert.equal(replies[i].error, undefined, `${JSON.stringify(source)}: ${replies[i].error}`);
    assert.equal(replies[i].text, hfRender(null, source, { x: 'X' }).text, JSON.stringify(source));
  });
});

// `lily tokenize --model DIR --render-messages`: the prompt of the checkpoint's own template.
function lilyPrompt(modelDir, messages) {
  const res = spawnSync(LILY_BIN, ['tokenize', '--model', modelDir, '--render-messages', JSON.stringify(messages), '--json'],
    { encoding: 'utf8' });
  if (res.status !== 0) return { error: res.stderr.trim() };
  return JSON.parse(res.stdout);
}

const PROMPT_LISTS = [
  [user('What is the capital of France?')],
  [sys('You are terse.'), user('Hi'), asst('Hello! How can I help?'), user('Tell me a joke.')],
  [user('q'), asst('<think>\nplan\n</think>\n\nanswer'), user('q2')],
  [sys(SPECIALS), user(UNICODE), asst('ok'), user('<tool_response>\n42\n</tool_response>')],
];

test('lily tokenize renders the checkpoint\'s chat_template.jinja (demo model), ids as Hugging Face encodes the text', async () => {
  const demoDir = fixture('models/demo');
  const hf = Tokenizer.fromFile(path.join(demoDir, 'tokenizer.json'));
  for (const messages of PROMPT_LISTS) {
    const got = lilyPrompt(demoDir, messages);
    const want = hfRender(path.join(demoDir, 'chat_template.jinja'), null, { messages, add_generation_prompt: true, enable_thinking: false });
    assert.equal(got.error, undefined, got.error);
    assert.equal(got.text, want.text, JSON.stringify(messages));
    if (!messages.some((m) => /<[|/]?[a-z_]+\|?>/.test(m.content)))
      assert.deepEqual(got.ids, (await hf.encode(got.text, null, { addSpecialTokens: false })).getIds(), 'ids');
  }
});

test('a checkpoint with another template (Qwen3.5/3.6 style) is rendered with it, history think blocks restored', () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'lily-jinja-'));
  try {
    for (const f of ['config.json', 'tokenizer.json', 'tokenizer_config.json', 'model.safetensors'])
      fs.symlinkSync(path.join(SOURCE_DIR, 'models/demo', f), path.join(dir, f));
    const file = fixture('tests/fixtures/jinja/qwen3_6_tools.jinja');
    fs.copyFileSync(file, path.join(dir, 'chat_template.jinja'));
    for (const messages of PROMPT_LISTS) {
      const got = lilyPrompt(dir, messages);
      const want = hfRender(file, null, { messages: nothinkRewrite(messages), add_generation_prompt: true, enable_thinking: false });
      assert.equal(got.error, undefined, got.error);
      assert.equal(got.text, want.text, JSON.stringify(messages));
    }
    // An unsupported construct is refused with the file and line.
    fs.writeFileSync(path.join(dir, 'chat_template.jinja'), 'ok\n{% include "x" %}\n');
    const refused = lilyPrompt(dir, [user('hi')]);
    assert.match(refused.error, /chat_template\.jinja: line 2: unsupported tag 'include'/);
  } finally {
    fs.rmSync(dir, { recursive: true, force: true });
  }
});
