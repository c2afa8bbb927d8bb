// The request fields that vLLM's clients send beside OpenAI's, against `lily serve` on the demo
// model: min_tokens, ignore_eos, stream_options.continuous_usage_stats, include_reasoning, an
// assistant message's `reasoning`, continue_final_message; the legacy completions' n, logprobs
// and echo; and the legacy completions endpoint's default max_tokens (16).
// One server for the file.
// Run: LILY_BIN=build/lily node --test tests/node/vllm_extras.test.mjs
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { MODEL, chat, parseSse, postJson, rawRequest, serverForSuite } from './server_harness.mjs';

const user = (content) => ({ role: 'user', content });
const messages = [user('What is CMake?')];

describe('vLLM request extras on lily serve (demo model)', () => {
  const suite = serverForSuite();
  /** POST /v1/completions streamed: the chunks, parsed. */
  const rawStream = async (body) => {
    const res = await rawRequest(suite.server, 'POST', '/v1/completions', {
      body: JSON.stringify(body), headers: { 'Content-Type': 'application/json' },
    });
    assert.equal(res.status, 200, res.body);
    return res.body.split('\n\n').map((e) => e.trim()).filter((e) => e && e !== 'data: [DONE]').map((e) => JSON.parse(e.slice(6)));
  };
  const ask = async (extra) => {
    const res = await chat(suite.server, { model: MODEL, messages, ...extra });
    assert.equal(res.status, 200, res.body);
    return res.json;
  };

  it('ignore_eos runs past the stop token to max_tokens; min_tokens holds it off that long', async () => {
    // The chat stop token, made the certain choice with logit_bias.
    const tok = await postJson(suite.server, '/tokenize', { model: MODEL, prompt: '<|im_end|>' });
    assert.equal(tok.json.tokens.length, 1);
    const eos = { [tok.json.tokens[0]]: 100 };
    const free = await ask({ max_tokens: 24, logit_bias: eos });
    assert.equal(free.choices[0].finish_reason, 'stop');
    assert.equal(free.usage.completion_tokens, 1);

    const ignored = await ask({ max_tokens: 24, logit_bias: eos, ignore_eos: true });
    assert.equal(ignored.choices[0].finish_reason, 'length');
    assert.equal(ignored.usage.completion_tokens, 24);
    assert.equal(ignored.choices[0].message.content, '');  // the stop token writes no text

    const held = await ask({ max_tokens: 24, logit_bias: eos, min_tokens: 5 });
    assert.equal(held.choices[0].finish_reason, 'stop');
    assert.equal(held.usage.completion_tokens, 6);
    assert.ok(held.choices[0].message.content.length > 0);
    // Streamed, the same tokens.
    const streamed = await chat(suite.server, { model: MODEL, messages, max_tokens: 24, logit_bias: eos, min_tokens: 5, stream: true });
    assert.equal(parseSse(streamed.body).text, held.choices[0].message.content);

    // stop_token_ids: the answer's own third token ends it (also with ignore_eos).
    const plain8 = await ask({ max_tokens: 8, logprobs: true });
    const third = (await postJson(suite.server, '/tokenize', { model: MODEL, prompt: plain8.choices[0].logprobs.content[2].token })).json.tokens;
    if (third.length === 1) {
      const stopped = await ask({ max_tokens: 8, stop_token_ids: third, ignore_eos: true });
      assert.equal(stopped.choices[0].finish_reason, 'stop');
      assert.equal(stopped.usage.completion_tokens, 3);
    }
    const badId = await chat(suite.server, { model: MODEL, messages, stop_token_ids: [99999999] });
    assert.equal(badId.status, 400);
    assert.equal(badId.json.error.param, 'stop_token_ids[0]');
    // Greedy without a stop in reach: min_tokens changes nothing.
    const plain = await ask({ max_tokens: 8 });
    assert.deepEqual((await ask({ max_tokens: 8, min_tokens: 8 })).choices[0].message, plain.choices[0].message);
    const over = await chat(suite.server, { model: MODEL, messages, max_tokens: 4, min_tokens: 5 });
    assert.equal(over.status, 400);
    assert.equal(over.json.error.param, 'min_tokens');
    // Without max_tokens, min_tokens past the context window: the message says what bounds it.
    const pastWindow = await chat(suite.server, { model: MODEL, messages, min_tokens: 1000000 });
    assert.equal(pastWindow.status, 400);
    assert.equal(pastWindow.json.error.param, 'min_tokens');
    assert.match(pastWindow.json.error.message, /^min_tokens \(1000000\) exceeds the \d+ tokens this request may generate: /);
    assert.match(pastWindow.json.error.message, /the prompt \(\d+ tokens\) leaves in this server's maximum context length of \d+ tokens$/);
    assert.doesNotMatch(pastWindow.json.error.message, /--/);
  });

  it('continuous_usage_stats puts the running usage in every chunk', async () => {
    const res = await chat(suite.server, {
      model: MODEL, messages, max_tokens: 12, stream: true,
      stream_options: { include_usage: true, continuous_usage_stats: true },
    });
    assert.equal(res.status, 200, res.body);
    const events = res.body.split('\n\n').map((e) => e.trim()).filter((e) => e && e !== 'data: [DONE]')
      .map((e) => JSON.parse(e.slice(6)));
    const withChoices = events.filter((c) => c.choices.length > 0);
    assert.ok(withChoices.length >= 3);
    let last = 0;
    for (const c of withChoices) {
      assert.ok(c.usage, JSON.stringify(c));
      assert.equal(c.usage.total_tokens, c.usage.prompt_tokens + c.usage.completion_tokens);
      assert.ok(c.usage.completion_tokens >= last);
      last = c.usage.completion_tokens;
    }
    const final = events.at(-1);
    assert.deepEqual(final.choices, []);
    assert.equal(final.usage.completion_tokens, last);
    assert.equal(final.usage.prompt_tokens, withChoices[0].usage.prompt_tokens);
    // Without the flag the chunks keep "usage": null.
    const plain = await chat(suite.server, {
      model: MODEL, messages, max_tokens: 4, stream: true, stream_options: { include_usage: true },
    });
    assert.ok(plain.body.includes('"usage":null'));
    assert.equal(parseSse(plain.body).usage.completion_tokens, 4);
  });

  it('include_reasoning false leaves the thinking out and the content as it was', async () => {
    const thinking = { chat_template_kwargs: { enable_thinking: true }, max_tokens: 48 };
    const full = await ask(thinking);
    assert.equal(typeof full.choices[0].message.reasoning_content, 'string');
    const bare = await ask({ ...thinking, include_reasoning: false });
    assert.equal(bare.choices[0].message.reasoning_content, undefined);
    assert.equal(bare.choices[0].message.content, full.choices[0].message.content);
    assert.equal(bare.usage.completion_tokens, full.usage.completion_tokens);
    const streamed = await chat(suite.server, { model: MODEL, messages, ...thinking, include_reasoning: false, stream: true });
    assert.ok(!streamed.body.includes('reasoning_content'));
    assert.equal(parseSse(streamed.body).text, full.choices[0].message.content);
  });

  it("an assistant turn's reasoning (vLLM's name) is its reasoning_content", async () => {
    const turns = (field) => [user('hi'), { role: 'assistant', content: 'hello', [field]: 'a thought' }, user('more')];
    const a = await postJson(suite.server, '/tokenize', { model: MODEL, messages: turns('reasoning') });
    const b = await postJson(suite.server, '/tokenize', { model: MODEL, messages: turns('reasoning_content') });
    assert.equal(a.status, 200, JSON.stringify(a.json));
    assert.deepEqual(a.json.tokens, b.json.tokens);
    const bad = await chat(suite.server, { model: MODEL, messages: turns('reasoning'), reasoning_effort: 'bogus' });
    assert.equal(bad.status, 400);
    assert.equal(bad.json.error.param, 'reasoning_effort');
  });

  it('continue_final_message goes on from the assistant text the client wrote', async () => {
    const whole = await ask({ max_tokens: 12, logprobs: true });
    const tokens = whole.choices[0].logprobs.content.map((t) => t.token);
    const text = whole.choices[0].message.content;
    assert.equal(tokens.join(''), text);
    // Cut after a word (a token that ends in a letter, followed by one that starts with a space).
    let k = 3;
    while (k < tokens.length - 2 && !tokens[k].startsWith(' ')) k++;
    const head = tokens.slice(0, k).join('');
    const cont = await ask({
      messages: [...messages, { role: 'assistant', content: head }], continue_final_message: true,
      add_generation_prompt: false, max_tokens: 12 - k,
    });
    assert.equal(head + cont.choices[0].message.content, text);
    assert.equal(cont.usage.completion_tokens, 12 - k);
    // /tokenize gives the prompt the continued request ran: its tokens are the usage's prompt.
    const tok = await postJson(suite.server, '/tokenize', {
      model: MODEL, messages: [...messages, { role: 'assistant', content: head }], continue_final_message: true,
    });
    assert.equal(tok.status, 200, JSON.stringify(tok.json));
    assert.equal(tok.json.count, cont.usage.prompt_tokens);
    const refused = await chat(suite.server, { model: MODEL, messages: [...messages, { role: 'assistant', content: head }] });
    assert.equal(refused.status, 400);
    assert.equal(refused.json.error.param, 'messages[1].role');
  });

  it('a developer message after the first names itself in the template error', async () => {
    const res = await chat(suite.server, {
      model: MODEL, messages: [user('hi'), { role: 'developer', content: 'be brief' }, user('more')],
    });
    assert.equal(res.status, 400);
    assert.equal(res.json.error.param, 'messages');
    assert.match(res.json.error.message, /System message must be at the beginning.*messages\[1\] is a system or developer message/);
    // Template variables beyond the thinking switches pass through.
    const ok = await chat(suite.server, { model: MODEL, messages, max_tokens: 2, chat_template_kwargs: { custom_flag: true } });
    assert.equal(ok.status, 200, ok.body);
  });

  it('legacy completions: n choices, logprobs as a count, echo; whole and streamed alike', async () => {
    const base = { model: MODEL, prompt: 'CMake is a', max_tokens: 8 };
    const whole = await postJson(suite.server, '/v1/completions', { ...base, n: 3, temperature: 1, seed: 5, logprobs: 2 });
    assert.equal(whole.status, 200, JSON.stringify(whole.json));
    assert.deepEqual(whole.json.choices.map((c) => c.index), [0, 1, 2]);
    for (const c of whole.json.choices) {
      const lp = c.logprobs;
      assert.equal(lp.tokens.length, lp.token_logprobs.length);
      assert.equal(lp.tokens.length, lp.top_logprobs.length);
      assert.equal(lp.tokens.join(''), c.text);  // the demo model's answers here are ASCII
      assert.ok(lp.top_logprobs.every((t) => Object.keys(t).length <= 2));
      assert.ok(lp.token_logprobs.every((x) => x <= 0));
      assert.equal(lp.text_offset[0], 0);
      for (let i = 1; i < lp.text_offset.length; i++) assert.equal(lp.text_offset[i], lp.text_offset[i - 1] + lp.tokens[i - 1].length);
    }
    assert.equal(whole.json.usage.completion_tokens, whole.json.choices.length * 8);
    // Streamed: chunks per choice index, the same texts and logprobs.
    const res = await rawStream({ ...base, n: 3, temperature: 1, seed: 5, logprobs: 2, stream: true });
    const texts = ['', '', ''];
    const tokens = [[], [], []];
    for (const c of res) {
      const ch = c.choices[0];
      texts[ch.index] += ch.text;
      if (ch.logprobs) tokens[ch.index].push(...ch.logprobs.tokens);
    }
    assert.deepEqual(texts, whole.json.choices.map((c) => c.text));
    assert.deepEqual(tokens, whole.json.choices.map((c) => c.logprobs.tokens));
    // echo: the prompt, then the completion.
    const plain = await postJson(suite.server, '/v1/completions', base);
    const echoed = await postJson(suite.server, '/v1/completions', { ...base, echo: true });
    assert.equal(echoed.json.choices[0].text, base.prompt + plain.json.choices[0].text);
    const echoStream = await rawStream({ ...base, echo: true, stream: true });
    assert.equal(echoStream[0].choices[0].text, base.prompt);
    assert.equal(echoStream.map((c) => c.choices[0]?.text ?? '').join(''), echoed.json.choices[0].text);
  });

  it('a legacy completion without max_tokens stops at 16 tokens', async () => {
    const res = await postJson(suite.server, '/v1/completions', {
      model: MODEL, prompt: 'CMake is a', ignore_eos: true, max_tokens: null,
    });
    assert.equal(res.status, 200, JSON.stringify(res.json));
    assert.equal(res.json.usage.completion_tokens, 16);
    assert.equal(res.json.choices[0].finish_reason, 'length');
    const longer = await postJson(suite.server, '/v1/completions', { model: MODEL, prompt: 'CMake is a', ignore_eos: true, min_tokens: 20 });
    assert.equal(longer.json.usage.completion_tokens, 20);
    const asked = await postJson(suite.server, '/v1/completions', { model: MODEL, prompt: 'CMake is a', ignore_eos: true, max_tokens: 40 });
    assert.equal(asked.json.usage.completion_tokens, 40);
  });
});
