// tool_choice "required" with several tools, end to end through the real server and the official
// `openai` client, on a scripted checkpoint (scripted_model.mjs). After the forced opening
// "<tool_call>\n<function=" this model, left to itself, names a tool nobody declared
// (lookup_weather) and closes the call. The server holds it to the declared names, token by token
// (engine/tool_call_constraint.h): every call that comes back, greedy or sampled, whole or
// streamed, for every one of n choices, names one of the declared tools. These tools take no
// parameters, so after the name the constraint leaves only the end of the block, which the model
// writes as the template does.
// Run: LILY_BIN=build/lily node --test tests/node/tool_choice_required.test.mjs
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { scriptedToolsModel } from './scripted_model.mjs';

const OPENING = '<tool_call>\n<function=';
const { harness } = await scriptedToolsModel('lily-tool-required-', {
  chains: [
    // The generation prompt (thinking off) ends in "</think>\n\n": plain text.
    { after: '<|im_start|>assistant\n<think>\n\n</think>\n\n', text: 'It is sunny.' },
    // After the opening: a name that is not declared, then a newline.
    { after: OPENING, text: 'lookup_weather>', then: '\n' },
    // After the newline that ends the name's line (written as "\n" or as part of ">\n"): the
    // end of the call, as the template writes it.
    { after: '\n', text: '</function>\n</tool_call>' },
    { after: '>\n', text: '</function>\n</tool_call>' },
  ],
  // The end of the call twice: spellings of its own for each.
  extraTokens: ['</function>\n</tool_call>', '\n</tool_call>'],
});
const { MODEL, assembleStream: assemble, postJson: post, serverForSuite } = harness;

// Short declarations keep the prompt short (the test also runs under the sanitizers).
const tools = ['get_time', 'set_counter', 'set_alarm'].map((name) => ({ type: 'function', function: { name } }));
const declared = new Set(tools.map((t) => t.function.name));
const question = [{ role: 'user', content: 'What now?' }];

describe('tool_choice "required" with several tools', () => {
  const suite = serverForSuite();

  const ask = (extra) => suite.openai.chat.completions.create({ model: MODEL, messages: question, tools, max_tokens: 48, ...extra });

  it('left to itself the model names an undeclared tool', async () => {
    // The same last token as a forced opening, without the server's constraint: raw text.
    const raw = await post(suite.server, '/v1/completions', { model: MODEL, prompt: OPENING, max_tokens: 32 });
    assert.equal(raw.status, 200, JSON.stringify(raw.json));
    assert.equal(raw.json.choices[0].text, 'lookup_weather>\n</function>\n</tool_call>');
  });

  it('greedy: the call names a declared tool, whole and streamed alike', async () => {
    const whole = await ask({ tool_choice: 'required' });
    const choice = whole.choices[0];
    assert.equal(choice.finish_reason, 'tool_calls', JSON.stringify(choice.message));
    assert.equal(choice.message.content, null);
    assert.equal(choice.message.tool_calls.length, 1);
    assert.ok(declared.has(choice.message.tool_calls[0].function.name), choice.message.tool_calls[0].function.name);
    assert.equal(choice.message.tool_calls[0].function.arguments, '{}');
    const { message, finish } = await assemble(await ask({ tool_choice: 'required', stream: true }));
    assert.equal(finish, 'tool_calls');
    assert.deepEqual(message.tool_calls.map((c) => c.function), choice.message.tool_calls.map((c) => c.function));
    // Thinking on: the think block is closed before the opening, and the name is held all the same.
    const thinking = await ask({ tool_choice: 'required', chat_template_kwargs: { enable_thinking: true } });
    assert.equal(thinking.choices[0].finish_reason, 'tool_calls');
    assert.equal(thinking.choices[0].message.reasoning_content, '');
    assert.deepEqual(thinking.choices[0].message.tool_calls.map((c) => c.function), choice.message.tool_calls.map((c) => c.function));
  });

  it('sampled: every call of every choice names a declared tool, streamed too', async () => {
    const request = { tool_choice: 'required', temperature: 1, seed: 1, n: 3 };
    const whole = await ask(request);
    assert.equal(whole.choices.length, 3);
    for (const c of whole.choices) {
      assert.equal(c.finish_reason, 'tool_calls', JSON.stringify(c.message));
      assert.equal(c.message.tool_calls.length, 1);
      assert.ok(declared.has(c.message.tool_calls[0].function.name), c.message.tool_calls[0].function.name);
    }
    const names = whole.choices.map((c) => c.message.tool_calls[0].function.name);
    assert.ok(new Set(names).size > 1, `sampling reaches more than one declared name: ${names}`);
    // The stream of the same request (same seed): the same calls, choice by choice.
    const { choices } = await assemble(await ask({ ...request, stream: true }));
    assert.deepEqual(choices.map((c) => c.message.tool_calls.map((t) => t.function.name)), names.map((name) => [name]));
    assert.deepEqual(choices.map((c) => c.finish), ['tool_calls', 'tool_calls', 'tool_calls']);
  });
});
