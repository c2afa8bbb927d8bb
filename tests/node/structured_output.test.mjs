// Structured output (response_format json_object and json_schema) against `lily serve` on the
// demo model, a model that was never taught JSON: whatever it would write, the answer is a
// document of the schema, whole or streamed, greedy or sampled, through the official client.
// Run: LILY_BIN=build/lily node --test tests/node/structured_output.test.mjs
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { MODEL, chat, parseSse, postJson, serverForSuite } from './server_harness.mjs';

const messages = [{ role: 'user', content: 'Describe CMake as JSON.' }];
const person = {
  type: 'object',
  properties: {
    name: { type: 'string', maxLength: 24 },
    age: { type: 'integer' },
    tags: { type: 'array', items: { type: 'string', maxLength: 8 }, maxItems: 3 },
    role: { enum: ['admin', 'user'] },
  },
  required: ['name', 'age', 'role'],
  additionalProperties: false,
};
const schemaFormat = { type: 'json_schema', json_schema: { name: 'person', schema: person, strict: true } };

/** Throws unless `v` follows `person`. */
function assertPerson(v) {
  assert.deepEqual(Object.keys(v).filter((k) => !(k in person.properties)), []);
  assert.equal(typeof v.name, 'string');
  assert.ok(Number.isInteger(v.age));
  assert.ok(['admin', 'user'].includes(v.role));
  if ('tags' in v) assert.ok(Array.isArray(v.tags) && v.tags.every((t) => typeof t === 'string'));
}

describe('structured output on lily serve (demo model)', () => {
  const suite = serverForSuite();

  it('json_object: the answer is one JSON object, ended by the stop token', async () => {
    // Free keys and strings end when the model closes them: lean it towards quotes and braces.
    const id = async (text) => (await postJson(suite.server, '/tokenize', { model: MODEL, prompt: text })).json.tokens;
    const [quote] = await id('"');
    const [brace] = await id('}');
    const res = await suite.openai.chat.completions.create({
      model: MODEL, messages, max_tokens: 200, response_format: { type: 'json_object' },
      logit_bias: { [quote]: 6, [brace]: 6 },
    });
    const text = res.choices[0].message.content;
    assert.equal(res.choices[0].finish_reason, 'stop', text);
    const v = JSON.parse(text);
    assert.ok(typeof v === 'object' && !Array.isArray(v) && v !== null, text);
    // Without the lean the demo model writes on; what it wrote is still a JSON prefix.
    const cut = await suite.openai.chat.completions.create({
      model: MODEL, messages, max_tokens: 24, response_format: { type: 'json_object' },
    });
    assert.match(cut.choices[0].message.content, /^\s*\{/);
  });

  it('json_schema: greedy, sampled and streamed answers follow the schema', async () => {
    for (const extra of [{}, { temperature: 0.8, seed: 3 }, { temperature: 0.8, seed: 4 }]) {
      const res = await suite.openai.chat.completions.create({
        model: MODEL, messages, max_tokens: 400, response_format: schemaFormat, ...extra,
      });
      const text = res.choices[0].message.content;
      assert.equal(res.choices[0].finish_reason, 'stop', text);
      assertPerson(JSON.parse(text));
    }
    const streamed = await chat(suite.server, { model: MODEL, messages, max_tokens: 400, response_format: schemaFormat, stream: true });
    const { text, finish } = parseSse(streamed.body);
    assert.equal(finish, 'stop');
    assertPerson(JSON.parse(text));
    const whole = await chat(suite.server, { model: MODEL, messages, max_tokens: 400, response_format: schemaFormat });
    assert.equal(whole.json.choices[0].message.content, text);  // greedy: the same document
  });

  it('with ignore_eos the answer still ends with its document', async () => {
    const res = await suite.openai.chat.completions.create({
      model: MODEL, messages, max_tokens: 400, response_format: schemaFormat, ignore_eos: true, temperature: 0.8, seed: 3,
    });
    assert.equal(res.choices[0].finish_reason, 'stop');
    assertPerson(JSON.parse(res.choices[0].message.content));
  });

  it('the legacy completions endpoint takes response_format too', async () => {
    const ids = async (text) => (await postJson(suite.server, '/tokenize', { model: MODEL, prompt: text })).json.tokens;
    const [quote] = await ids('"');
    const [brace] = await ids('}');
    const res = await postJson(suite.server, '/v1/completions', {
      model: MODEL, prompt: 'A JSON object:', max_tokens: 100, response_format: { type: 'json_object' },
      logit_bias: { [quote]: 6, [brace]: 6 },
    });
    assert.equal(res.status, 200, JSON.stringify(res.json));
    const v = JSON.parse(res.json.choices[0].text);
    assert.ok(typeof v === 'object' && v !== null && !Array.isArray(v));
  });

  it('with thinking on, the document follows the think block', async () => {
    const ids = async (text) => (await postJson(suite.server, '/tokenize', { model: MODEL, prompt: text })).json.tokens;
    const [thinkEnd] = await ids('</think>');
    const [quote] = await ids('"');
    const [brace] = await ids('}');
    const thinking = { chat_template_kwargs: { enable_thinking: true } };
    // Leaned to end its thinking at once, then to close strings and objects: an empty
    // reasoning and a document of the schema as the content, whole and streamed alike.
    const lean = { logit_bias: { [thinkEnd]: 100, [quote]: 6, [brace]: 6 } };
    const body = { model: MODEL, messages, max_tokens: 400, response_format: schemaFormat, ...thinking, ...lean };
    const whole = await chat(suite.server, body);
    assert.equal(whole.status, 200, JSON.stringify(whole.json));
    const message = whole.json.choices[0].message;
    assert.equal(whole.json.choices[0].finish_reason, 'stop', message.content);
    assert.equal(message.reasoning_content, '');
    assertPerson(JSON.parse(message.content));
    const streamed = parseSse((await chat(suite.server, { ...body, stream: true })).body);
    assert.equal(streamed.finish, 'stop');
    assert.equal(streamed.text, message.content);
    // Unleaned, the demo model thinks on: its reasoning, no document, cut by max_tokens.
    const long = await chat(suite.server, { model: MODEL, messages, max_tokens: 12, response_format: schemaFormat, ...thinking });
    assert.equal(long.status, 200, JSON.stringify(long.json));
    assert.equal(long.json.choices[0].finish_reason, 'length');
    assert.ok(long.json.choices[0].message.reasoning_content.length > 0);
    assert.ok(!long.json.choices[0].message.content);
  });

  it('refuses a schema it cannot follow, naming it', async () => {
    const res = await chat(suite.server, {
      model: MODEL, messages,
      response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'object', allOf: [] } } },
    });
    assert.equal(res.status, 400);
    assert.equal(res.json.error.param, 'response_format.json_schema.schema');
    assert.match(res.json.error.message, /unsupported JSON schema keyword 'allOf'/);
  });
});
