// Tokenizer goldens: lily's encode/decode/incremental decode against the official Hugging Face
// tokenizers binding (npm tokenizers@0.23.2) on the corpus tests/fixtures/tokenizer_corpus.jsonl
// plus seeded random text, for the real Qwen3 tokenizer, the demo model's, a small fixture with
// the Qwen3.5 regex and Qwen3.6 control-token ids, and variants of that fixture.
//
// lily's semantics, checked here:
//   encode(text, allow_special=true)  == HF encode(text, addSpecialTokens=false)
//   encode(text, allow_special=false) == HF encode of the same file without its added tokens
//   decode(ids, skip)                 == HF decode(ids, skip)   (invalid UTF-8 -> U+FFFD)
//   invalid UTF-8 input bytes         == HF encode of Buffer.toString('utf8') (U+FFFD per maximal
//                                        ill-formed subpart; JS strings cannot hold raw bytes)
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { test } from 'node:test';
import {
  SOURCE_DIR, hfReferences, lilyBatch, loadCorpus, qwen3TokenizerPath, randomText, rng,
} from './tokenizer_support.mjs';

const corpus = loadCorpus();
const textOf = (item) => (item.hex !== undefined ? Buffer.from(item.hex, 'hex').toString('utf8') : item.text);

function randomCases(seed, count) {
  const next = rng(seed);
  return Array.from({ length: count }, (_, i) => ({ name: `random_${seed}_${i}`, text: randomText(next) }));
}

// Random id sequences: byte tokens (split UTF-8), specials, unknown ids, ordinary tokens.
function randomIdLists(seed, vocabSize, specialIds, count) {
  const next = rng(seed);
  return Array.from({ length: count }, () => {
    const n = 1 + Math.floor(next() * 30);
    return Array.from({ length: n }, () => {
      const r = next();
      if (r < 0.4) return Math.floor(next() * 256);
      if (r < 0.55) return specialIds[Math.floor(next() * specialIds.length)];
      if (r < 0.6) return vocabSize + 5 + Math.floor(next() * 100);
      return Math.floor(next() * vocabSize);
    });
  });
}

async function hfEncode(tok, text) {
  return (await tok.encode(text, null, { addSpecialTokens: false })).getIds();
}

// Compares lily with HF on every case; collects all mismatches into one failure message.
async function checkTokenizer(file, cases, idSeed) {
  const ref = hfReferences(file);
  const requests = [];
  for (const c of cases) {
    const enc = c.hex !== undefined ? { encode_hex: c.hex } : { encode: c.text };
    requests.push({ ...enc, special: true }, { ...enc, special: false });
  }
  const replies = lilyBatch(file, requests);
  const mismatches = [];
  const decodeCases = [];
  for (let i = 0; i < cases.length; i++) {
    const text = textOf(cases[i]);
    const wantSpecial = await hfEncode(ref.special, text);
    const wantPlain = await hfEncode(ref.plain, text);
    const [gotSpecial, gotPlain] = [replies[2 * i], replies[2 * i + 1]];
    if (JSON.stringify(gotSpecial.ids) !== JSON.stringify(wantSpecial))
      mismatches.push(`${cases[i].name} (special): lily ${JSON.stringify(gotSpecial)} hf ${JSON.stringify(wantSpecial)}`);
    if (JSON.stringify(gotPlain.ids) !== JSON.stringify(wantPlain))
      mismatches.push(`${cases[i].name} (plain): lily ${JSON.stringify(gotPlain)} hf ${JSON.stringify(wantPlain)}`);
    decodeCases.push({ name: cases[i].name, ids: wantSpecial, text });
  }
  const vocabSize = ref.special.getVocabSize(true);
  const specialIds = (ref.json.added_tokens ?? []).map((t) => t.id);
  for (const ids of randomIdLists(idSeed, vocabSize, specialIds.length ? specialIds : [0], 150))
    decodeCases.push({ name: `ids ${JSON.stringify(ids)}`, ids });
  await checkDecode(file, ref, decodeCases, mismatches);
  assert.deepEqual(mismatches.slice(0, 10), [], `${mismatches.length} mismatches with Hugging Face tokenizers`);
}

async function checkDecode(file, ref, cases, mismatches) {
  const requests = [];
  for (const c of cases)
    for (const skip of [true, false])
      requests.push({ decode: c.ids, skip_special: skip }, { incremental: c.ids, skip_special: skip });
  const replies = lilyBatch(file, requests);
  let r = 0;
  for (const c of cases) {
    for (const skip of [true, false]) {
      const want = await ref.special.decode(c.ids, skip);
      const got = replies[r++];
      const inc = replies[r++];
      if (got.text !== want) mismatches.push(`${c.name} decode(skip=${skip}): lily ${JSON.stringify(got)} hf ${JSON.stringify(want)}`);
      if (!inc.pieces || inc.pieces.join('') !== want)
        mismatches.push(`${c.name} incremental(skip=${skip}): lily ${JSON.stringify(inc)} hf ${JSON.stringify(want)}`);
      // When the whole decode is clean, no piece may hold a U+FFFD (a character split across pieces).
      if (!want.includes('\ufffd') && inc.pieces?.some((p) => p.includes('\ufffd')))
        mismatches.push(`${c.name} incremental emitted a partial character: ${JSON.stringify(inc.pieces)}`);
    }
  }
}

const smallFixture = path.join(SOURCE_DIR, 'tests/fixtures/tokenizer_small.json');
const allCases = [...corpus, ...randomCases(1, 200)];

test('small fixture (Qwen3.5 regex, Qwen3.6 control ids, "a b" merges) matches HF', async () => {
  await checkTokenizer(smallFixture, allCases, 11);
});

test('demo model tokenizer matches HF', async () => {
  await checkTokenizer(path.join(SOURCE_DIR, 'models/demo/tokenizer.json'), allCases, 12);
});

test('real Qwen3 tokenizer matches HF', async () => {
  await checkTokenizer(qwen3TokenizerPath(), [...corpus, ...randomCases(2, 300)], 13);
});

// Variants of the small fixture exercise the other supported tokenizer.json shapes.
function writeVariant(name, edit) {
  const json = JSON.parse(fs.readFileSync(smallFixture, 'utf8'));
  edit(json);
  const file = path.join(fs.mkdtempSync(path.join(os.tmpdir(), 'lily-tok-')), `${name}.json`);
  fs.writeFileSync(file, JSON.stringify(json));
  return file;
}

test('variant: no normalizer matches HF', async () => {
  await checkTokenizer(writeVariant('no_nfc', (j) => { j.normalizer = null; }), allCases, 21);
});

test('variant: bare ByteLevel pre-tokenizer (GPT-2 regex) matches HF', async () => {
  const file = writeVariant('gpt2', (j) => {
    j.pre_tokenizer = { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: true };
  });
  await checkTokenizer(file, allCases, 22);
});

test('variant: ignore_merges and pair-form merges match HF', async () => {
  const file = writeVariant('ignore_merges', (j) => {
    j.model.ignore_merges = true;
    j.model.merges = j.model.merges.map((m) => m.split(' '));
  });
  await checkTokenizer(file, allCases, 23);
});

// New added tokens outside the vocabulary are numbered from the vocabulary's entry count (3282).
test('variant: normalized added token (matched after NFC) matches HF', async () => {
  const file = writeVariant('normalized_added', (j) => {
    j.added_tokens.push({ id: 3282, content: 'Åland', single_word: false, lstrip: false, rstrip: false, normalized: true, special: false });
    j.added_tokens.push({ id: 3283, content: '<|raw|>', single_word: false, lstrip: false, rstrip: false, normalized: false, special: true });
  });
  const cases = [...corpus, { name: 'nfc_added', text: 'A\u030aland Åland <|raw|>A\u030aland<|raw|>Ålan' }];
  await checkTokenizer(file, cases, 24);
});

test('unsupported tokenizer.json parts are rejected with a clear error', () => {
  const bad = [
    ['normalizer', (j) => { j.normalizer = { type: 'NFKC' }; }, /normalizer.*NFKC/],
    ['model type', (j) => { j.model.type = 'WordPiece'; }, /model.*WordPiece/],
    ['split behavior', (j) => { j.pre_tokenizer.pretokenizers[0].behavior = 'Removed'; }, /Isolated/],
    ['decoder', (j) => { j.decoder = { type: 'Metaspace' }; }, /decoder/],
    ['byte fallback', (j) => { j.model.byte_fallback = true; }, /byte_fallback/],
    ['lstrip', (j) => { j.added_tokens[0].lstrip = true; }, /lstrip/],
  ];
  for (const [name, edit, pattern] of bad) {
    const file = writeVariant(`bad_${name.replace(' ', '_')}`, edit);
    assert.throws(() => lilyBatch(file, [{ encode: 'x' }]), pattern, name);
  }
});

test('added tokens whose written ids differ from what HF assigns are rejected', () => {
  const file = writeVariant('bad_ids', (j) => { delete j.model.vocab['<|endoftext|>']; });
  const hf = hfReferences(file).special;
  assert.notEqual(hf.tokenToId('<|endoftext|>'), 248044);  // HF silently renumbers it
  assert.throws(() => lilyBatch(file, [{ encode: 'x' }]), /would give it id/);
});
