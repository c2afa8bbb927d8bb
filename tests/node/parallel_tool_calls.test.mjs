// parallel_tool_calls end to end through the real server and the official `openai` client, on a
// scripted checkpoint (scripted_model.mjs) that answers by itself with some text and two tool
// calls in a row. By default (or with parallel_tool_calls true) both calls come back; with
// parallel_tool_calls false the answer ends with the first call: the engine stops generating at
// the token that completes it (usage counts the tokens up to there), and whole and streamed
// answers hold that one call, also for each of n choices.
// Run: LILY_BIN=build/lily node --test tests/node/parallel_tool_calls.test.mjs
import { before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { scriptedToolsModel } from './scripted_model.mjs';

const FIRST_CALL = '<tool_call>\n<function=set_counter>\n<parameter=name>visits</parameter></function></tool_call>';
const ANSWER = `Sure.\n${FIRST_CALL}\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>`;
const { harness, chains } = await scriptedToolsModel('lily-parallel-tools-', {
  // The second call repeats markers the first one spends; these give it spellings of its own.
  extraTokens: ['\n<tool_call>\n<function=', '>\n</function>\n</tool_call>'],
  // The generation prompt (thinking off) ends in "</think>\n\n": two calls after a sentence.
  chains: [{ after: '<|im_start|>assistant\n<think>\n\n</think>\n\n', text: ANSWER }],
});
const { MODEL, assembleStream: assemble, postJson: post, serverForSuite } = harness;

const tools = [
  { type: 'function', function: { name: 'set_counter', description: 'Sets a counter',
    parameters: { type: 'object', properties: { name: { type: 'string' } }, required: ['name'] } } },
  { type: 'function', function: { name: 'get_time', description: 'The time', parameters: { type: 'object', properties: {} } } },
];
const question = [{ role: 'user', content: 'Count my visits, then tell me the time.' }];

describe('parallel_tool_calls on a scripted model', () => {
  const suite = serverForSuite();
  let firstCallTokens;  // tokens of the answer up to the one that completes the first call
  before(async () => {
    const ids = chains[0].ids;
    for (let k = 1; k <= ids.length && firstCallTokens === undefined; ++k) {
      const text = (await post(suite.server, '/detokenize', { tokens: ids.slice(0, k) })).json.prompt;
      if (text.includes('</tool_call>')) firstCallTokens = k;
    }
    assert.ok(firstCallTokens > 0 && firstCallTokens < ids.length, String(firstCallTokens));
  });

  const ask = (extra) => suite.openai.chat.completions.create({ model: MODEL, messages: question, tools, max_tokens: 64, ...extra });
  const calls = (message) => message.tool_calls.map((c) => ({ name: c.function.name, arguments: JSON.parse(c.function.arguments) }));
  const bothCalls = [{ name: 'set_counter', arguments: { name: 'visits' } }, { name: 'get_time', arguments: {} }];

  it('returns every call by default and with parallel_tool_calls true', async () => {
    for (const parallel_tool_calls of [undefined, true]) {
      const r = await ask({ parallel_tool_calls });
      const choice = r.choices[0];
      assert.equal(choice.finish_reason, 'tool_calls');
      assert.equal(choice.message.content, 'Sure.');
      assert.deepEqual(calls(choice.message), bothCalls);
      assert.equal(r.usage.completion_tokens, chains[0].ids.length + 1);  // and <|im_end|>
      const { message, finish } = await assemble(await ask({ parallel_tool_calls, stream: true }));
      assert.equal(finish, 'tool_calls');
      assert.deepEqual(calls(message), bothCalls);
    }
  });

  it('with parallel_tool_calls false ends the answer with its first call', async () => {
    const r = await ask({ parallel_tool_calls: false });
    const choice = r.choices[0];
    assert.equal(choice.finish_reason, 'tool_calls');
    assert.equal(choice.message.content, 'Sure.');
    assert.deepEqual(calls(choice.message), bothCalls.slice(0, 1));
    assert.match(choice.message.tool_calls[0].id, /^call_[0-9a-f]{24}$/);
    // Generation stopped at the token that completed the call: nothing after it was generated.
    assert.equal(r.usage.completion_tokens, firstCallTokens);
  });

  it('streams the one call as deltas equal to the whole answer, usage included', async () => {
    const whole = await ask({ parallel_tool_calls: false });
    const { message, finish, usage } = await assemble(
      await ask({ parallel_tool_calls: false, stream: true, stream_options: { include_usage: true } }));
    assert.equal(finish, 'tool_calls');
    assert.equal(message.content, whole.choices[0].message.content);
    assert.equal(message.tool_calls.length, 1);
    assert.deepEqual(message.tool_calls.map((c) => c.function), whole.choices[0].message.tool_calls.map((c) => c.function));
    assert.equal(usage.completion_tokens, firstCallTokens);
  });

  it('holds each of n choices to one call, whole and streamed', async () => {
    const r = await ask({ parallel_tool_calls: false, n: 2 });
    assert.deepEqual(r.choices.map((c) => c.finish_reason), ['tool_calls', 'tool_calls']);
    assert.deepEqual(r.choices.map((c) => calls(c.message)), [bothCalls.slice(0, 1), bothCalls.slice(0, 1)]);
    assert.equal(r.usage.completion_tokens, 2 * firstCallTokens);
    const { choices } = await assemble(await ask({ parallel_tool_calls: false, n: 2, stream: true }));
    assert.deepEqual(choices.map((c) => c.message.tool_calls.map((t) => t.function.name)), [['set_counter'], ['set_counter']]);
    assert.deepEqual(choices.map((c) => c.finish), ['tool_calls', 'tool_calls']);
  });

  it('is plain text with tool_choice "none", parallel_tool_calls false or not', async () => {
    const r = await ask({ parallel_tool_calls: false, tool_choice: 'none' });
    assert.equal(r.choices[0].finish_reason, 'stop');
    assert.equal(r.choices[0].message.tool_calls, undefined);
    assert.equal(r.choices[0].message.content, ANSWER);
  });

  it('cuts a call that max_tokens ends before its close: content, finish_reason "length"', async () => {
    const r = await ask({ parallel_tool_calls: false, max_tokens: firstCallTokens - 1 });
    assert.equal(r.choices[0].finish_reason, 'length');
    assert.equal(r.choices[0].message.tool_calls, undefined);
    const content = r.choices[0].message.content;
    assert.ok(content.startsWith('Sure.') && content.includes('<tool_call>\n<function=set_counter>'), content);
  });
});
