// Encoding speed of the Hugging Face tokenizers Node binding (npm tokenizers@0.23.2) on the same
// ~1 MiB of mixed text as bench/tokenizer_bench.cpp, with the real Qwen3 tokenizer.
// Run from the repository root after scripts/setup.sh:
//   node bench/tokenizer_bench.mjs
// Prints the median of 15 timed encodes (after 3 warm-up encodes) and the decode time.
import fs from 'node:fs';
import path from 'node:path';
import { createRequire } from 'node:module';

const root = path.resolve(import.meta.dirname, '..');
const require = createRequire(path.join(root, 'tests/node/package.json'));
const { Tokenizer } = require('tokenizers');

// Left out, as in tokenizer_bench.cpp: single very long runs (worst cases, not typical text).
const PATHOLOGICAL = new Set(['long_space_run', 'repeated_chars']);

function benchText() {
  const lines = fs.readFileSync(path.join(root, 'tests/fixtures/tokenizer_corpus.jsonl'), 'utf8').split('\n');
  const joined = lines.filter((l) => l.trim()).map((l) => JSON.parse(l)).filter((i) => i.text !== undefined && !PATHOLOGICAL.has(i.name)).map((i) => i.text).join('\n');
  let out = '';
  for (let round = 0; Buffer.byteLength(out) < 1 << 20; round++) out += `round ${round}\n${joined}\n`;
  return out;
}

const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];

const tok = Tokenizer.fromFile(path.join(root, 'tests/node/.cache/qwen3-tokenizer.json'));
const text = benchText();
const bytes = Buffer.byteLength(text);
let ids = [];
for (let i = 0; i < 3; i++) ids = (await tok.encode(text, null, { addSpecialTokens: false })).getIds();
const times = [];
for (let i = 0; i < 15; i++) {
  const t0 = process.hrtime.bigint();
  await tok.encode(text, null, { addSpecialTokens: false });
  times.push(Number(process.hrtime.bigint() - t0) / 1e6);
}
const decodeTimes = [];
for (let i = 0; i < 5; i++) {
  const t0 = process.hrtime.bigint();
  await tok.decode(ids, true);
  decodeTimes.push(Number(process.hrtime.bigint() - t0) / 1e6);
}
const ms = median(times);
console.log(JSON.stringify({
  bytes, tokens: ids.length, encode_ms_median: +ms.toFixed(2), encode_mib_per_s: +(bytes / 1048576 / (ms / 1000)).toFixed(2),
  decode_ms_median: +median(decodeTimes).toFixed(2),
}));
