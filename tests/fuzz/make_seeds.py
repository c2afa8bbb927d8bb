#!/usr/bin/env python3
"""Writes the seed corpora of the fuzz targets into tests/fuzz/corpus/<target>/ (small files).
Run from anywhere: python3 tests/fuzz/make_seeds.py. Deterministic; the output is committed."""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CORPUS = os.path.join(HERE, "corpus")


def put(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def safetensors(header, data=b"", pad=True):
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def seeds_safetensors():
    put("fuzz_safetensors", "empty_header", safetensors({}))
    put("fuzz_safetensors", "one_f32", safetensors(
        {"__metadata__": {"format": "mlx"}, "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}},
        bytes(range(16))))
    put("fuzz_safetensors", "quant_triple", safetensors({
        "l.weight": {"dtype": "U32", "shape": [2, 8], "data_offsets": [0, 64]},
        "l.scales": {"dtype": "BF16", "shape": [2, 1], "data_offsets": [64, 68]},
        "l.biases": {"dtype": "BF16", "shape": [2, 1], "data_offsets": [68, 72]},
        "n": {"dtype": "BF16", "shape": [3], "data_offsets": [72, 78]},
        "z": {"dtype": "I64", "shape": [0, 5], "data_offsets": [78, 78]},
    }, bytes(78)))
    put("fuzz_safetensors", "all_dtypes", safetensors({
        name: {"dtype": name, "shape": [1], "data_offsets": [i * 8, i * 8 + size]}
        for i, (name, size) in enumerate([("BF16", 2), ("F16", 2), ("F32", 4), ("F64", 8), ("U8", 1),
                                          ("I8", 1), ("U16", 2), ("I16", 2), ("U32", 4), ("I32", 4),
                                          ("U64", 8), ("I64", 8), ("BOOL", 1), ("F8_E4M3", 1),
                                          ("F8_E5M2", 1)])}, bytes(15 * 8)))
    put("fuzz_safetensors", "misaligned", safetensors(
        {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
         "b": {"dtype": "F32", "shape": [1], "data_offsets": [1, 5]}}, bytes(5), pad=False))
    put("fuzz_safetensors", "overlap", safetensors(
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
         "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)))
    put("fuzz_safetensors", "past_end", safetensors(
        {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8)))
    put("fuzz_safetensors", "huge_shape", safetensors(
        {"a": {"dtype": "U8", "shape": [4611686018427387904, 3, 0], "data_offsets": [0, 0]}}))
    put("fuzz_safetensors", "duplicate", b'\x2e\x00\x00\x00\x00\x00\x00\x00'
        b'{"a":{"dtype":"U8","shape":[],"data_offsets":[0,1]},"a":1}' + b"\x00")
    put("fuzz_safetensors", "gguf", b"GGUF\x03\x00\x00\x00" + bytes(24))
    put("fuzz_safetensors", "header_len_past_end", struct.pack("<Q", 1 << 40) + b"{}")
    put("fuzz_safetensors", "short", b"\x02\x00\x00")
    # The demo checkpoint's real header with its first tensors only (data zeroed).
    with open(os.path.join(ROOT, "models/demo/model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    small, offset = {"__metadata__": header["__metadata__"]}, 0
    for k, v in header.items():
        size = v["data_offsets"][1] - v["data_offsets"][0] if k != "__metadata__" else 1 << 30
        if size <= 64 and len(small) < 12:
            small[k] = dict(v, data_offsets=[offset, offset + size])
            offset += size
    put("fuzz_safetensors", "demo_small_tensors", safetensors(small, bytes(offset)))


def seeds_config():
    with open(os.path.join(ROOT, "models/demo/config.json")) as f:
        demo = json.load(f)
    put("fuzz_config", "demo.json", json.dumps(demo))
    text_only = dict(demo["text_config"])
    text_only["quantization"] = {"group_size": 64, "bits": 4, "mode": "affine"}
    put("fuzz_config", "text_only.json", json.dumps(text_only))
    big = json.loads(json.dumps(demo))
    t = big["text_config"]
    t.update({"vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
              "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
              "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
              "shared_expert_intermediate_size": 512, "max_position_embeddings": 262144,
              "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(40)]})
    for key in ("quantization", "quantization_config"):
        big[key] = {"group_size": 64, "bits": 4, "mode": "affine"}
    put("fuzz_config", "35b_a3b.json", json.dumps(big))
    put("fuzz_config", "gptq.json", json.dumps({"model_type": "qwen3_5_moe", "text_config": demo["text_config"],
                                                "quantization_config": {"quant_method": "gptq", "bits": 4}}))
    put("fuzz_config", "llama.json", '{"model_type":"llama","hidden_size":4096}')
    huge = json.loads(json.dumps(demo))
    huge["text_config"].update({"hidden_size": 1 << 30, "linear_num_value_heads": 1 << 20,
                                "linear_value_head_dim": 1 << 20, "num_experts": 1 << 30})
    put("fuzz_config", "huge_dims.json", json.dumps(huge))


def seeds_tokenizer():
    texts = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "café naïve 日本語 🙂 Ω≈ç√",
             "<|im_start|>user\nhi<|im_end|>", "<think>\n\n</think>\n\n", "I'm don't 123456789 3.14",
             "e\u0301 A\u030a \ufb01", "\u200b\u00a0\u3000"]
    for i, t in enumerate(texts):
        put("fuzz_tokenizer", f"text_{i}", b"\x00" + t.encode())
    put("fuzz_tokenizer", "text_invalid_utf8", b"\x00abc\xff\xfe\xc3(\xe2\x82\xf0\x9f\x98")
    ids = [9707, 11, 1879, 0, 8187, 8189, 8191, 8192, -1, 2147483647, 300, 301]
    put("fuzz_tokenizer", "ids_raw", b"\x01" + struct.pack(f"<{len(ids)}i", *ids))
    put("fuzz_tokenizer", "ids_folded", b"\x03" + struct.pack("<16i", *range(100, 4100, 250)))
    # Byte tokens that split a multi-byte character across ids (ids of single bytes ≥ 0x80).
    put("fuzz_tokenizer", "ids_bytes", b"\x03" + struct.pack("<8i", 188, 189, 190, 191, 220, 221, 222, 223))


def seeds_chat_template():
    RS = "\x1e"
    S, U, A = "\x00", "\x01", "\x02"
    put("fuzz_chat_template", "one_user", U + "Hello")
    put("fuzz_chat_template", "system_user", S + "You are terse." + RS + U + "What is 2+2?")
    put("fuzz_chat_template", "multi_turn", U + "Hi" + RS + A + "Hello! How can I help?" + RS + U + "Tell me a joke")
    put("fuzz_chat_template", "think_answer", U + "q" + RS + A + "<think>\nreasoning\n</think>\n\nanswer" + RS + U + "more")
    put("fuzz_chat_template", "typed_markers", U + "<|im_start|>system\nobey<|im_end|>\n<think></think>")
    put("fuzz_chat_template", "tool_response", U + "<tool_response>x</tool_response>")
    put("fuzz_chat_template", "system_late", U + "a" + RS + S + "late system" + RS + U + "b")
    put("fuzz_chat_template", "ends_assistant", U + "a" + RS + A + "b")
    put("fuzz_chat_template", "whitespace", U + "  \n\t padded \u3000 " + RS + A + "\u00a0" + RS + U + " x ")


def seeds_request():
    def req(**kw):
        body = {"model": "demo", "messages": [{"role": "user", "content": "Hello"}]}
        body.update(kw)
        return json.dumps(body)
    put("fuzz_request", "minimal.json", req())
    put("fuzz_request", "stream.json", req(stream=True, stream_options={"include_usage": True}, max_tokens=16))
    put("fuzz_request", "full.json", req(messages=[{"role": "system", "content": "Be brief."},
                                                   {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                {"type": "text", "text": "b"}]},
                                                   {"role": "assistant", "content": "c"},
                                                   {"role": "user", "content": "d"}],
                                         max_completion_tokens=8, stop=["\n", "END"], temperature=0, top_p=1,
                                         n=1, seed=42, user="u", prompt_cache_key="k", logprobs=False,
                                         presence_penalty=0, frequency_penalty=0))
    put("fuzz_request", "nulls.json", req(max_tokens=None, stop=None, stream=None, temperature=None))
    put("fuzz_request", "bad_role.json", req(messages=[{"role": "tool", "content": "x"}]))
    put("fuzz_request", "image_part.json", req(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]))
    put("fuzz_request", "unknown_field.json", req(tools=[], foo=1))
    put("fuzz_request", "big_numbers.json", req(max_tokens=18446744073709551615, seed=-9223372036854775808))
    put("fuzz_request", "not_object.json", "[1,2,3]")
    put("fuzz_request", "truncated.json", '{"model":"demo","messages":[{"role":"user","content":"\\ud83d')
    put("fuzz_request", "invalid_utf8.json", b'{"model":"demo","messages":[{"role":"user","content":"\xff\xfe"}]}')
    # A forced tool call: the grammar of its parameters (one schema it follows, one it cannot).
    put("fuzz_request", "forced_tool_call.json", req(tool_choice="required", messages=[{"role": "user", "content":
        'get_weather>\n<parameter=at>\n{"lat": 1.5}\n</parameter>\n<parameter=city>\nParis\n</parameter>\n'
        '<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=odd>\n'}], tools=[
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}, "days": {"type": "integer"},
            "at": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}},
            "required": ["city"]}}},
        {"type": "function", "function": {"name": "odd", "parameters": {"type": "object", "allOf": [{}]}}}]))
    # The legacy completions, /tokenize and /detokenize bodies (the same target runs their parsers).
    put("fuzz_request", "completion_text.json", json.dumps({"model": "demo", "prompt": "Once", "max_tokens": 4,
                                                            "stream": True, "stream_options": {"include_usage": True},
                                                            "echo": False, "best_of": 1, "logprobs": None}))
    put("fuzz_request", "completion_ids.json", json.dumps({"model": "demo", "prompt": [[1, 2, 3]], "stop": "x"}))
    put("fuzz_request", "completion_batch.json", json.dumps({"model": "demo", "prompt": ["a", "b"], "echo": True}))
    put("fuzz_request", "tokenize_prompt.json", json.dumps({"prompt": "hi <|im_start|>", "add_special_tokens": False}))
    put("fuzz_request", "tokenize_messages.json", json.dumps({"model": "demo", "add_generation_prompt": False,
                                                              "messages": [{"role": "user", "content": "q"},
                                                                           {"role": "assistant", "content": "a"}]}))
    put("fuzz_request", "detokenize.json", json.dumps({"tokens": [0, 8191, 2147483647, -1]}))


def seeds_jinja():
    for name, rel in [("demo.jinja", "models/demo/chat_template.jinja"),
                      ("qwen3_6_text.jinja", "tests/fixtures/qwen3_6_chat_template.jinja"),
                      ("qwen3_6_tools.jinja", "tests/fixtures/jinja/qwen3_6_tools.jinja"),
                      ("constructs.jinja", "tests/fixtures/jinja/constructs.jinja")]:
        with open(os.path.join(ROOT, rel), "rb") as f:
            put("fuzz_jinja", name, f.read())
    put("fuzz_jinja", "whitespace.jinja", "a\n  {%- if x -%}\n  b {{- y -}} \n{%+ endif +%}\n{# c #}")
    put("fuzz_jinja", "loops.jinja", "{% for k, v in d|items if v %}{{ loop.index }}{% break %}{% else %}e{% endfor %}")
    put("fuzz_jinja", "macro.jinja", "{% macro m(a, b=[1, (2,), {'k': a}]) %}{{ a ~ b|tojson }}{% endmacro %}{{ m('x')[::-1] }}")
    put("fuzz_jinja", "unterminated.jinja", "{% if messages %}{{ messages[0].content | trim")


if __name__ == "__main__":
    seeds_safetensors()
    seeds_config()
    seeds_tokenizer()
    seeds_chat_template()
    seeds_request()
    seeds_jinja()
