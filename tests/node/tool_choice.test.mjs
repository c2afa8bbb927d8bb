// Tool calls end to end through the real server and the official `openai` client, on a scripted
// checkpoint (scripted_model.mjs) whose template renders tools. Left to itself the model answers
// "It is sunny."; only after the opening of a call (which the server forces for tool_choice
// "required" or a named function) does it go on to write a call's name and arguments. So a call
// comes back exactly when the server constrained the answer: whole and streamed, with the tool
// result sent back in a `tool` message, tool_choice "none" answering text, and a call cut off by
// max_tokens returned as content with finish_reason "length".
// Run: LILY_BIN=build/lily node --test tests/node/tool_choice.test.mjs
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import OpenAI from 'openai';
import { encode, scriptedToolsModel } from './scripted_model.mjs';

const NAMED_OPENING = '<tool_call>\n<function=set_counter>\n';
const { harness, modelDir } = await scriptedToolsModel('lily-tool-choice-', {
  chains: [
    // The generation prompt (thinking off) ends in "</think>\n\n": plain text.
    { after: '<|im_start|>assistant\n<think>\n\n</think>\n\n', text: 'It is sunny.' },
    // After the opening of "required": the function's name, then the named opening's last token.
    { after: '<tool_call>\n<function=', text: 'set_counter', then: NAMED_OPENING },
    // After a named opening: the arguments and the end of the call as the template writes them
    // (spelled with the tokens still free: one bigram token cannot occur twice).
    { after: NAMED_OPENING,
      text: '<parameter=name>\nvisits\n</parameter>\n<parameter=value>\n42\n</parameter>\n</function>\n</tool_call>' },
  ],
  // Spellings for the markers the arguments repeat (the bigram model needs distinct tokens).
  extraTokens: ['name>\n', 'value>\n', '\n</parameter>\n</function>', '\n</tool_call>'],
});
const { LILY_BIN, MODEL, assembleStream: assemble, postJson: post, serverForSuite } = harness;

const tools = [
  { type: 'function', function: { name: 'set_counter', description: 'Sets a counter',
    parameters: { type: 'object', properties: { name: { type: 'string' }, value: { type: 'integer' } }, required: ['name', 'value'] } } },
  { type: 'function', function: { name: 'get_time', description: 'The time', parameters: { type: 'object', properties: {} } } },
];
const question = [{ role: 'user', content: 'Count my visits.' }];
const named = (name) => ({ type: 'function', function: { name } });

describe('tool_choice on a scripted model', () => {
  const suite = serverForSuite();

  const ask = (extra) => suite.openai.chat.completions.create({ model: MODEL, messages: question, tools, max_tokens: 64, ...extra });

  it('answers text by itself: tool_choice "auto" and "none" (tools then stay out of the prompt)', async () => {
    for (const tool_choice of [undefined, 'auto', 'none']) {
      const r = await ask({ tool_choice });
      assert.equal(r.choices[0].message.content, 'It is sunny.', String(tool_choice));
      assert.equal(r.choices[0].message.tool_calls, undefined);
      assert.equal(r.choices[0].finish_reason, 'stop');
    }
    const withTools = await post(suite.server, '/tokenize', { messages: question, tools });
    const none = await post(suite.server, '/tokenize', { messages: question, tools, tool_choice: 'none' });
    const text = async (t) => (await post(suite.server, '/detokenize', { tokens: t.json.tokens })).json.prompt;
    assert.ok((await text(withTools)).includes('"name": "set_counter"'));
    assert.ok(!(await text(none)).includes('set_counter'));
  });

  it('"required" makes the answer a call, whose name the model writes', async () => {
    const r = await ask({ tool_choice: 'required' });
    const choice = r.choices[0];
    assert.equal(choice.finish_reason, 'tool_calls');
    assert.equal(choice.message.content, null);
    assert.equal(choice.message.tool_calls.length, 1);
    const call = choice.message.tool_calls[0];
    assert.match(call.id, /^call_[0-9a-f]{24}$/);
    assert.equal(call.type, 'function');
    assert.equal(call.function.name, 'set_counter');
    assert.deepEqual(JSON.parse(call.function.arguments), { name: 'visits', value: 42 });  // typed by the schema
  });

  it('a named function makes the answer a call of that function; the opening counts as prompt', async () => {
    const r = await ask({ tool_choice: named('set_counter') });
    assert.equal(r.choices[0].finish_reason, 'tool_calls');
    assert.equal(r.choices[0].message.tool_calls[0].function.name, 'set_counter');
    assert.deepEqual(JSON.parse(r.choices[0].message.tool_calls[0].function.arguments), { name: 'visits', value: 42 });
    const prompt = await post(suite.server, '/tokenize', { messages: question, tools });
    assert.equal(r.usage.prompt_tokens, prompt.json.count + encode(LILY_BIN, modelDir, NAMED_OPENING).length);
    // The other function, named, is the one called; it declares no parameters, so the server
    // holds the model to none (engine/tool_call_constraint.h), whatever it would write.
    const other = await ask({ tool_choice: named('get_time') });
    assert.equal(other.choices[0].finish_reason, 'tool_calls');
    assert.equal(other.choices[0].message.tool_calls[0].function.name, 'get_time');
    assert.equal(other.choices[0].message.tool_calls[0].function.arguments, '{}');
  });

  it('streams the forced call as deltas that assemble to the whole message', async () => {
    for (const tool_choice of ['required', named('set_counter')]) {
      const whole = await ask({ tool_choice });
      const { message, finish } = await assemble(await ask({ tool_choice, stream: true }));
      assert.equal(finish, 'tool_calls');
      assert.equal(message.content, '');
      assert.equal(message.tool_calls.length, 1);
      assert.match(message.tool_calls[0].id, /^call_/);
      assert.deepEqual(message.tool_calls.map((c) => c.function), whole.choices[0].message.tool_calls.map((c) => c.function));
    }
    // Every choice of n is forced, streamed or not.
    const several = await ask({ tool_choice: 'required', n: 2 });
    assert.deepEqual(several.choices.map((c) => c.finish_reason), ['tool_calls', 'tool_calls']);
    const { choices } = await assemble(await ask({ tool_choice: 'required', n: 2, stream: true }));
    assert.deepEqual(choices.map((c) => c.message.tool_calls.map((t) => t.function.name)), [['set_counter'], ['set_counter']]);
    assert.deepEqual(choices.map((c) => c.finish), ['tool_calls', 'tool_calls']);
  });

  it('forces the call after the thinking too: the think block is closed, reasoning empty', async () => {
    const r = await ask({ tool_choice: named('set_counter'), chat_template_kwargs: { enable_thinking: true } });
    assert.equal(r.choices[0].finish_reason, 'tool_calls');
    assert.equal(r.choices[0].message.reasoning_content, '');
    assert.equal(r.choices[0].message.tool_calls[0].function.name, 'set_counter');
  });

  it('takes the tool result back in a tool message and answers it', async () => {
    const first = await ask({ tool_choice: 'required' });
    const call = first.choices[0].message.tool_calls[0];
    const messages = [...question, first.choices[0].message, { role: 'tool', tool_call_id: call.id, content: '{"visits": 42}' }];
    const prompt = await post(suite.server, '/tokenize', { messages, tools });
    assert.equal(prompt.status, 200, JSON.stringify(prompt.json));
    const text = (await post(suite.server, '/detokenize', { tokens: prompt.json.tokens })).json.prompt;
    assert.ok(text.includes('<tool_call>\n<function=set_counter>\n<parameter=name>\nvisits\n</parameter>\n<parameter=value>\n42\n</parameter>'), text);
    assert.ok(text.includes('<tool_response>\n{"visits": 42}\n</tool_response>'), text);
    const second = await suite.openai.chat.completions.create({ model: MODEL, messages, tools, max_tokens: 64 });
    assert.equal(second.choices[0].message.content, 'It is sunny.');
    assert.equal(second.choices[0].finish_reason, 'stop');
    assert.equal(second.usage.prompt_tokens, prompt.json.count);
  });

  it('returns a call cut off by max_tokens as content with finish_reason "length"', async () => {
    const r = await ask({ tool_choice: named('set_counter'), max_tokens: 3 });
    assert.equal(r.choices[0].finish_reason, 'length');
    assert.equal(r.choices[0].message.tool_calls, undefined);
    assert.ok(r.choices[0].message.content.startsWith(`${NAMED_OPENING}<parameter=name>`), r.choices[0].message.content);
    const { message, finish } = await assemble(await ask({ tool_choice: named('set_counter'), max_tokens: 3, stream: true }));
    assert.equal(finish, 'length');
    assert.equal(message.content, r.choices[0].message.content);
  });

  it('refuses a named function that is not declared, naming the field', async () => {
    await assert.rejects(ask({ tool_choice: named('get_weather') }), (e) => {
      assert.ok(e instanceof OpenAI.BadRequestError, String(e));
      assert.equal(e.param, 'tool_choice.function.name');
      return true;
    });
  });
});
