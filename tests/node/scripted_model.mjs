// A checkpoint whose answers are scripted, for end-to-end tests of what the server makes of a
// model's output (tool calls above all). It is the demo model with its weights rewritten into a
// bigram model: every layer's output projection is zero, so the hidden state that reaches the
// head is the embedding of the last token alone, and the head maps that token to one chosen
// successor. Greedy decoding (and sampling: the margin is 240 logits) then spells a fixed chain
// of tokens after a given last prompt token, and ends it with <|im_end|>; a last token without a
// chain ends the answer at once. Each token has one successor, so the tokens of all chains are
// distinct; the vocabulary gains a few added tokens (the tool-call markers, as Qwen's tokenizer
// has) so that the markers a call repeats have distinct spellings. The chat template is the
// Qwen3.5/3.6-style test template, which renders tools and tool results.
import fs from 'node:fs';
import path from 'node:path';
import { spawnSync } from 'node:child_process';

/** Non-special added tokens of the scripted vocabulary (decoded as text, as Qwen's <tool_call>). */
export const ADDED_TOKENS = ['<tool_call>', '</tool_call>', '</function>', '</parameter>', '\n</parameter>', '<parameter=',
  '\n<parameter='];

const GROUP = 64;  // MLX quantization group size of the demo checkpoint
const IM_END = '<|im_end|>';

/** GPT-2's byte-level alphabet: the character of each byte in tokenizer.json's vocabulary. */
function byteDecoder() {
  const bs = [];
  for (let b = 33; b <= 126; ++b) bs.push(b);
  for (let b = 161; b <= 172; ++b) bs.push(b);
  for (let b = 174; b <= 255; ++b) bs.push(b);
  const cs = [...bs];
  let n = 0;
  for (let b = 0; b < 256; ++b) if (!bs.includes(b)) { bs.push(b); cs.push(256 + n++); }
  return new Map(cs.map((c, i) => [String.fromCodePoint(c), bs[i]]));
}

/** id → the token's bytes as a latin1 string (one char per byte), for the spelling search. */
function tokenBytes(tokenizer) {
  const dec = byteDecoder();
  const out = new Map();
  for (const [s, id] of Object.entries(tokenizer.model.vocab))
    out.set(id, Buffer.from([...s].map((ch) => dec.get(ch))).toString('latin1'));
  for (const t of tokenizer.added_tokens) if (!t.special) out.set(t.id, Buffer.from(t.content).toString('latin1'));
  return out;
}

/**
 * Token ids whose bytes concatenate to `text`, none of them in `used` (which gains them): a
 * depth-first search, longest tokens first. null when there is none.
 */
function spell(text, byBytes, used) {
  const target = Buffer.from(text).toString('latin1');
  const out = [];
  const go = (pos) => {
    if (pos === target.length) return true;
    for (let len = Math.min(32, target.length - pos); len > 0; --len) {
      for (const id of byBytes.get(target.slice(pos, pos + len)) ?? []) {
        if (used.has(id)) continue;
        used.add(id);
        out.push(id);
        if (go(pos + len)) return true;
        used.delete(id);
        out.pop();
      }
    }
    return false;
  };
  return go(0) ? out : null;
}

/** The ids of `text` as lily encodes text the server writes (added-token strings matched). */
export function encode(lilyBin, modelDir, text) {
  const r = spawnSync(lilyBin, ['tokenize', '--model', modelDir, '--special', '--json', text], { encoding: 'utf8' });
  if (r.status !== 0) throw new Error(`lily tokenize failed: ${r.stderr}`);
  return JSON.parse(r.stdout).ids;
}

/** The safetensors file as {header, data}; header maps names to {dtype, shape, data_offsets}. */
function readSafetensors(file) {
  const buf = fs.readFileSync(file);
  const n = Number(buf.readBigUInt64LE(0));
  return { header: JSON.parse(buf.subarray(8, 8 + n).toString('utf8')), data: buf.subarray(8 + n) };
}

function writeSafetensors(file, metadata, tensors) {
  const header = { __metadata__: metadata };
  let offset = 0;
  for (const [name, t] of tensors) {
    header[name] = { dtype: t.dtype, shape: t.shape, data_offsets: [offset, offset + t.bytes.length] };
    offset += t.bytes.length;
  }
  let text = JSON.stringify(header);
  text += ' '.repeat((8 - (text.length % 8)) % 8);
  const len = Buffer.alloc(8);
  len.writeBigUInt64LE(BigInt(Buffer.byteLength(text)));
  fs.writeFileSync(file, Buffer.concat([len, Buffer.from(text), ...tensors.map(([, t]) => t.bytes)]));
}

/**
 * A 4-bit MLX matrix [rows, cols] with scale 1 and bias 0 in every group, all codes 0 but the
 * `cells` [row, col, code (1 … 15)]: {weight, scales, biases} tensors.
 */
function quantized4(rows, cols, cells) {
  const weight = Buffer.alloc(rows * cols / 2);
  for (const [row, col, q] of cells) {
    const at = (row * cols + col) / 8 | 0;
    const word = weight.readUInt32LE(at * 4) | (q << (4 * (col % 8)));
    weight.writeUInt32LE(word >>> 0, at * 4);
  }
  const groups = rows * cols / GROUP;
  const scales = Buffer.alloc(groups * 2);
  for (let g = 0; g < groups; ++g) scales.writeUInt16LE(0x3f80, g * 2);  // bf16 1.0
  return {
    weight: { dtype: 'U32', shape: [rows, cols / 8], bytes: weight },
    scales: { dtype: 'BF16', shape: [rows, cols / GROUP], bytes: scales },
    biases: { dtype: 'BF16', shape: [rows, cols / GROUP], bytes: Buffer.alloc(groups * 2) },
  };
}

/**
 * Writes the scripted checkpoint into `dir` (created) from `sourceDir` (models/demo) and
 * `template` (a chat_template.jinja). `chains`: [{after, text, then?}]: after a prompt whose
 * text ends with `after` (only its last token counts), the model writes `text` and then the
 * last token of `then` (a chain that continues another one's `after`), or <|im_end|>.
 * `extraTokens`: more non-special added tokens (after ADDED_TOKENS), for chains that repeat a
 * marker more often than the vocabulary has distinct spellings of it.
 * Returns {chains: [{from, ids, to}]} with the token ids chosen.
 */
export function writeScriptedModel({ lilyBin, sourceDir, template, dir, chains, extraTokens = [] }) {
  fs.cpSync(sourceDir, dir, { recursive: true });
  fs.copyFileSync(template, path.join(dir, 'chat_template.jinja'));
  const config = JSON.parse(fs.readFileSync(path.join(dir, 'config.json'), 'utf8'));
  const tc = config.text_config;
  const hidden = tc.hidden_size;

  const tokenizerFile = path.join(dir, 'tokenizer.json');
  const tokenizer = JSON.parse(fs.readFileSync(tokenizerFile, 'utf8'));
  let next = tokenizer.added_tokens.reduce((m, t) => Math.max(m, t.id), 0) + 1;
  for (const content of [...ADDED_TOKENS, ...extraTokens])
    tokenizer.added_tokens.push({ id: next++, content, single_word: false, lstrip: false, rstrip: false,
      normalized: false, special: false });
  fs.writeFileSync(tokenizerFile, JSON.stringify(tokenizer));
  const vocab = Math.ceil(next / GROUP) * GROUP;
  tc.vocab_size = vocab;
  fs.writeFileSync(path.join(dir, 'config.json'), JSON.stringify(config, null, 2));

  const last = (text) => encode(lilyBin, dir, text).at(-1);
  const imEnd = tokenizer.added_tokens.find((t) => t.content === IM_END).id;
  const byBytes = new Map();
  for (const [id, bytes] of tokenBytes(tokenizer)) {
    if (!byBytes.has(bytes)) byBytes.set(bytes, []);
    byBytes.get(bytes).push(id);
  }
  // The successor of each token that has one; the chain ends and starts are reserved first.
  const planned = chains.map((c) => ({ from: last(c.after), to: c.then === undefined ? imEnd : last(c.then), text: c.text }));
  const used = new Set([imEnd, ...planned.flatMap((c) => [c.from, c.to])]);
  const successor = new Map();
  for (const c of planned) {
    c.ids = spell(c.text, byBytes, used);
    if (!c.ids) throw new Error(`no spelling of ${JSON.stringify(c.text)} with unused tokens`);
    const seq = [c.from, ...c.ids, c.to];
    for (let i = 0; i + 1 < seq.length; ++i) {
      if (successor.has(seq[i])) throw new Error(`token ${seq[i]} would have two successors`);
      successor.set(seq[i], seq[i + 1]);
    }
  }
  if (successor.size + 1 > hidden) throw new Error('more scripted tokens than hidden dimensions');

  // Embeddings: a token with a successor gets its own dimension (1, 2, …); all others share 0,
  // whose successor is <|im_end|>. The head scores a token on the dimensions of its predecessors.
  const dim = new Map([...successor.keys()].map((id, i) => [id, i + 1]));
  const embedCells = [];
  for (let id = 0; id < vocab; ++id) embedCells.push([id, dim.get(id) ?? 0, 1]);
  const headCells = [[imEnd, 0, 15]];
  for (const [id, s] of successor) headCells.push([s, dim.get(id), 15]);
  const embed = quantized4(vocab, hidden, embedCells);
  const head = quantized4(vocab, hidden, headCells);

  const file = path.join(dir, 'model.safetensors');
  const { header, data } = readSafetensors(file);
  const tensors = [];
  for (const [name, info] of Object.entries(header)) {
    if (name === '__metadata__') continue;
    const m = name.match(/^(.*\.(?:embed_tokens|lm_head))\.(weight|scales|biases)$/);
    if (m) {
      tensors.push([name, (m[1].endsWith('embed_tokens') ? embed : head)[m[2]]]);
      continue;
    }
    let bytes = Buffer.from(data.subarray(info.data_offsets[0], info.data_offsets[1]));
    // Every other projection is zero (its scales and biases are), so no layer adds anything.
    if (/\.(scales|biases)$/.test(name)) bytes.fill(0);
    if (name.endsWith('model.norm.weight')) for (let i = 0; i < bytes.length; i += 2) bytes.writeUInt16LE(0x3f80, i);
    tensors.push([name, { dtype: info.dtype, shape: info.shape, bytes }]);
  }
  writeSafetensors(file, header.__metadata__, tensors);
  return { chains: planned };
}

/**
 * A scripted checkpoint with the Qwen3.5/3.6-style tools template (tests/fixtures/jinja/
 * qwen3_6_tools.jinja) in a fresh temporary folder named after `prefix`, made the model of
 * server_harness.mjs (LILY_TEST_MODEL_DIR) and removed after the test file. `chains` and
 * `extraTokens` as writeScriptedModel. Must run before anything else imports server_harness.mjs.
 * Returns {harness (the server_harness.mjs module), chains (writeScriptedModel's), modelDir}.
 */
export async function scriptedToolsModel(prefix, { chains, extraTokens = [] }) {
  const os = await import('node:os');
  const { after } = await import('node:test');
  const source = process.env.LILY_SOURCE_DIR ?? path.resolve(import.meta.dirname, '..', '..');
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), prefix));
  const modelDir = path.join(tmp, 'scripted');
  process.env.LILY_TEST_MODEL_DIR = modelDir;
  const harness = await import('./server_harness.mjs');
  after(() => fs.rmSync(tmp, { recursive: true, force: true }));
  const written = writeScriptedModel({
    lilyBin: harness.LILY_BIN,
    sourceDir: path.join(source, 'models', 'demo'),
    template: path.join(source, 'tests/fixtures/jinja/qwen3_6_tools.jinja'),
    dir: modelDir,
    chains,
    extraTokens,
  });
  return { harness, chains: written.chains, modelDir };
}
