// Forced tool calls held to the declared parameters (engine/tool_call_constraint.h) against
// `lily serve` on the demo model, a model that was never taught tools: with tool_choice
// "required" or a named function, whatever it would write, every call comes back as tool_calls
// whose arguments parse as JSON and satisfy the tool's schema (required keys, types, enum,
// maxLength, no undeclared key), greedy or sampled, whole or streamed, for each of n choices.
// Run: LILY_BIN=build/lily node --test tests/node/tool_choice_schema.test.mjs
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { MODEL, chat, serverForSuite, assembleStream } from './server_harness.mjs';

const weather = {
  type: 'function',
  function: {
    name: 'get_weather',
    parameters: {
      type: 'object',
      properties: {
        city: { type: 'string', maxLength: 16 },
        unit: { type: 'string', enum: ['celsius', 'fahrenheit'] },
        days: { type: 'integer' },
        detail: { type: 'boolean' },
      },
      required: ['city', 'unit', 'days'],
    },
  },
};
const alarm = {
  type: 'function',
  function: {
    name: 'set_alarm',
    parameters: {
      type: 'object',
      properties: {
        hour: { type: 'integer' },
        minute: { type: 'integer' },
        label: { type: 'string', maxLength: 10 },
        repeat: { type: 'array', items: { enum: ['mon', 'tue'] }, maxItems: 2 },
      },
      required: ['hour', 'minute'],
    },
  },
};
const tools = [weather, alarm];
const messages = [{ role: 'user', content: 'What is the weather in Paris?' }];
const chars = (s) => [...s].length;

/** Throws unless `v` satisfies `schema` (the keywords the tools above use). */
function assertValid(v, schema, at = 'arguments') {
  if (schema.enum) assert.ok(schema.enum.includes(v), `${at}: ${JSON.stringify(v)} not in the enum`);
  if (schema.type === 'string') {
    assert.equal(typeof v, 'string', at);
    if (schema.maxLength !== undefined) assert.ok(chars(v) <= schema.maxLength, `${at}: too long: ${JSON.stringify(v)}`);
  }
  if (schema.type === 'integer') assert.ok(Number.isInteger(v), `${at}: ${v} is no integer`);
  if (schema.type === 'boolean') assert.equal(typeof v, 'boolean', at);
  if (schema.type === 'array') {
    assert.ok(Array.isArray(v), at);
    if (schema.maxItems !== undefined) assert.ok(v.length <= schema.maxItems, at);
    v.forEach((item, i) => assertValid(item, schema.items, `${at}[${i}]`));
  }
  if (schema.type === 'object') {
    assert.ok(v !== null && typeof v === 'object' && !Array.isArray(v), at);
    for (const key of schema.required ?? []) assert.ok(key in v, `${at}: '${key}' is missing`);
    for (const [key, value] of Object.entries(v)) {
      assert.ok(key in schema.properties, `${at}: '${key}' is not declared`);
      assertValid(value, schema.properties[key], `${at}.${key}`);
    }
  }
}

/** Throws unless `choice` ({message, finish}) is only tool calls, each valid; returns the names. */
function assertCalls({ message, finish }, allowed = tools) {
  assert.equal(finish, 'tool_calls', JSON.stringify(message));
  assert.ok(!message.content, JSON.stringify(message));
  assert.ok(message.tool_calls.length >= 1);
  return message.tool_calls.map((call) => {
    const tool = allowed.find((t) => t.function.name === call.function.name);
    assert.ok(tool, `undeclared: ${call.function.name}`);
    assertValid(JSON.parse(call.function.arguments), tool.function.parameters);
    return call.function.name;
  });
}

const whole = (res) => res.choices.map((c) => ({ message: c.message, finish: c.finish_reason }));

describe('forced tool calls follow the declared parameters (demo model)', () => {
  const suite = serverForSuite();
  const ask = (extra) => suite.openai.chat.completions.create({ model: MODEL, messages, tools, max_tokens: 300, ...extra });

  it('named: greedy, whole and streamed alike, and with thinking on', async () => {
    const named = { type: 'function', function: { name: 'get_weather' } };
    const res = await ask({ tool_choice: named });
    const [choice] = whole(res);
    assert.deepEqual(assertCalls(choice), ['get_weather']);
    const streamed = await assembleStream(await ask({ tool_choice: named, stream: true }));
    assertCalls(streamed);
    assert.deepEqual(streamed.message.tool_calls.map((c) => c.function), choice.message.tool_calls.map((c) => c.function));
    const thinking = await ask({ tool_choice: named, chat_template_kwargs: { enable_thinking: true } });
    assert.equal(thinking.choices[0].message.reasoning_content, '');
    assertCalls(whole(thinking)[0]);
  });

  it('required: sampled with seeds, n > 1, streamed; further calls follow the schema too', async () => {
    // Seed 1: the second choice writes two calls (room for a few more).
    const streamed = await assembleStream(await ask({ tool_choice: 'required', temperature: 1, seed: 1, n: 2, max_tokens: 1200, stream: true }));
    assert.equal(streamed.choices.length, 2);
    const calls = streamed.choices.map((c) => assertCalls(c));
    assert.ok(calls.some((names) => names.length > 1), JSON.stringify(calls));
    // parallel_tool_calls false: exactly one call per choice.
    const single = await ask({ tool_choice: 'required', parallel_tool_calls: false, temperature: 0.8, seed: 5, n: 2 });
    for (const c of whole(single)) assert.equal(assertCalls(c).length, 1);
  });

  it('required with one tool, and ignore_eos: the answer ends with its call', async () => {
    const res = await ask({ tools: [alarm], tool_choice: 'required', ignore_eos: true, temperature: 0.7, seed: 9 });
    assert.deepEqual(assertCalls(whole(res)[0], [alarm]), ['set_alarm']);
  });

  it('a stop string that cuts a second call: content, finish "stop", whole and streamed', async () => {
    const a = { type: 'function', function: { name: 'a', parameters: { type: 'object', properties: {}, additionalProperties: false } } };
    const b = { type: 'function', function: { name: 'b', parameters: { type: 'object', properties: { s: { type: 'string' } }, required: ['s'] } } };
    const body = { model: MODEL, messages: [{ role: 'user', content: 'go' }], tools: [a, b], tool_choice: 'required',
      max_tokens: 200, seed: 9, temperature: 1, stop: ['e'] };
    // Seed 9: the model writes a() whole, then the "e" of "<parameter" ends the answer in b's call.
    const res = await suite.openai.chat.completions.create(body);
    const [choice] = whole(res);
    assert.equal(choice.finish, 'stop', JSON.stringify(choice));
    assert.deepEqual(choice.message.tool_calls.map((c) => c.function.name), ['a']);
    assert.ok(choice.message.content.startsWith('<tool_call>\n<function=b>'), JSON.stringify(choice.message));
    const streamed = await assembleStream(await suite.openai.chat.completions.create({ ...body, stream: true }));
    assert.equal(streamed.finish, 'stop');
    assert.equal(streamed.message.content, choice.message.content);
    assert.deepEqual(streamed.message.tool_calls.map((c) => c.function), choice.message.tool_calls.map((c) => c.function));
  });

  it('a schema the constraint cannot follow falls back to the forced opening alone', async () => {
    const odd = { type: 'function', function: { name: 'odd', parameters: { type: 'object', properties: { a: { type: 'string' } },
      allOf: [{ required: ['a'] }] } } };
    const res = await chat(suite.server, { model: MODEL, messages, tools: [odd], tool_choice: 'required', max_tokens: 16 });
    assert.equal(res.status, 200, JSON.stringify(res.json));
    // The model is free after the name: whatever it wrote is a call or (cut off) content.
    const m = res.json.choices[0].message;
    assert.ok(m.tool_calls?.length === 1 || m.content.startsWith('<tool_call>\n<function=odd>\n'), JSON.stringify(m));
  });
});
