// Shared helpers of the tokenizer and template tests: run `lily tokenize --batch-jsonl`, load the
// Hugging Face reference tokenizers, the corpus, a seeded random-text generator, and lily's
// nothink rewrite of the messages a reference template renders.
//
// Batch protocol (one JSON object per line on stdin, one reply per line on stdout):
//   {"encode": TEXT, "special": BOOL}        -> {"ids": [...]}
//   {"encode_hex": HEX, "special": BOOL}     -> {"ids": [...]}     (raw bytes, may be invalid UTF-8)
//   {"decode": [IDS], "skip_special": BOOL}  -> {"text": TEXT}
//   {"incremental": [IDS], "skip_special": BOOL} -> {"pieces": [push(id)..., flush()]}
//   {"render": [MESSAGES]}                   -> {"text": TEXT, "ids": [...]}
//   any failure                              -> {"error": MESSAGE}
import { spawnSync } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { Tokenizer } from 'tokenizers';

export const SOURCE_DIR = process.env.LILY_SOURCE_DIR ?? path.resolve(import.meta.dirname, '../..');
export const LILY_BIN = process.env.LILY_BIN ?? path.join(SOURCE_DIR, 'build/lily');

/** Runs one batch of requests through lily; returns the parsed replies, in order. */
export function lilyBatch(tokenizerFile, requests) {
  const input = requests.map((r) => JSON.stringify(r)).join('\n') + '\n';
  const res = spawnSync(LILY_BIN, ['tokenize', '--tokenizer', tokenizerFile, '--batch-jsonl', '-'], {
    input, maxBuffer: 1 << 30, encoding: 'utf8',
  });
  if (res.status !== 0) throw new Error(`lily tokenize failed (${res.status}): ${res.stderr}`);
  const lines = res.stdout.split('\n').filter((l) => l.length > 0);
  if (lines.length !== requests.length) throw new Error(`expected ${requests.length} replies, got ${lines.length}`);
  return lines.map((l) => JSON.parse(l));
}

/** Path of the real Qwen3 tokenizer (copied out of node_modules by fetch-qwen3-tokenizer.sh). */
export function qwen3TokenizerPath() {
  const file = path.join(import.meta.dirname, '.cache/qwen3-tokenizer.json');
  if (!fs.existsSync(file)) {
    const r = spawnSync(path.join(import.meta.dirname, 'fetch-qwen3-tokenizer.sh'), { encoding: 'utf8' });
    if (r.status !== 0) throw new Error(`fetch-qwen3-tokenizer.sh failed: ${r.stderr}`);
  }
  return file;
}

/**
 * The Hugging Face references for one tokenizer.json: `special` is the file as is (added tokens
 * matched, = lily encode(allow_special=true)); `plain` is the same file without added tokens
 * (= lily encode(allow_special=false): added-token strings are plain text).
 */
export function hfReferences(file) {
  const json = JSON.parse(fs.readFileSync(file, 'utf8'));
  const special = Tokenizer.fromString(JSON.stringify(json));
  const plain = Tokenizer.fromString(JSON.stringify({ ...json, added_tokens: [] }));
  return { json, special, plain };
}

/** The corpus: [{name, text}] plus [{name, hex}] items with raw (possibly invalid) bytes. */
export function loadCorpus() {
  const file = path.join(SOURCE_DIR, 'tests/fixtures/tokenizer_corpus.jsonl');
  return fs.readFileSync(file, 'utf8').split('\n').filter((l) => l.trim()).map((l) => JSON.parse(l));
}

export { rng } from './prng.mjs';

/** The empty think block a generation prompt ends with when thinking is off. */
export const THINK_BLOCK = '<think>\n\n</think>\n\n';

/**
 * lily's deliberate deviation from the Qwen3 template (docs/model.md §6.1), applied to a message
 * list before a reference Jinja engine renders it: every assistant turn up to the last real user
 * query (not a <tool_response> wrapper) starts with THINK_BLOCK and has an empty
 * reasoning_content. Returns a new array; the messages given are not changed.
 */
export function nothinkRewrite(messages) {
  let lastQuery = -1;
  for (let i = messages.length - 1; i >= 0 && lastQuery < 0; i--) {
    const c = messages[i].content.trim();
    if (messages[i].role === 'user' && !(c.startsWith('<tool_response>') && c.endsWith('</tool_response>'))) lastQuery = i;
  }
  return messages.map((m, i) => {
    if (m.role !== 'assistant' || i > lastQuery) return m;
    return { ...m, content: m.content.startsWith(THINK_BLOCK) ? m.content : THINK_BLOCK + m.content, reasoning_content: '' };
  });
}

const POOLS = [
  [0x61, 0x7a], [0x41, 0x5a], [0x30, 0x39], [0x20, 0x20], [0x20, 0x20], [0x09, 0x0d], [0x21, 0x2f],
  [0x3a, 0x40], [0xa0, 0xff], [0x300, 0x36f], [0x4e00, 0x4fff], [0x900, 0x97f], [0x600, 0x6ff],
  [0x1f300, 0x1f6ff], [0x200d, 0x200d], [0xfe0f, 0xfe0f], [0x1100, 0x11ff], [0xac00, 0xac80],
  [0x2000, 0x206f], [0x3000, 0x303f], [0x27, 0x27], [0x1f3fb, 0x1f3ff],
];
const WORDS = ['<|im_start|>', '<|im_end|>', '<think>', '</think>', '<tool_call>', "'s", "'LL", ' the', '\n\n', '   '];

/** A random string mixing scripts, marks, emoji, whitespace and control-token strings. */
export function randomText(next, maxParts = 40) {
  let s = '';
  const parts = 1 + Math.floor(next() * maxParts);
  for (let i = 0; i < parts; i++) {
    if (next() < 0.08) {
      s += WORDS[Math.floor(next() * WORDS.length)];
      continue;
    }
    const [lo, hi] = POOLS[Math.floor(next() * POOLS.length)];
    const n = 1 + Math.floor(next() * 6);
    for (let k = 0; k < n; k++) s += String.fromCodePoint(lo + Math.floor(next() * (hi - lo + 1)));
  }
  return s;
}
