#!/usr/bin/env python3
"""N streamed chat completions sent to a running `lily serve` at the same moment.

Prints, per request, the time to its first text and to the end of its stream, and the
aggregate output tokens per second (all tokens over the wall time of the whole set). With
--tokens 1 the end of a stream is its time to first token, which also works where the model's
tokens stream no text (a random-weight checkpoint's are often special tokens). The figures the
continuous-batching work is judged by: the last request's first token, and the aggregate
against the same requests one after another. Standard library only (the GPU machine has no
package registry).

Usage: scripts/concurrent-streams.py --url http://127.0.0.1:8080 [--streams 8] [--tokens 256]
       [--prompt-words 0]
--prompt-words N lengthens each prompt by N words (" memory" repeated, one token each with the
Qwen tokenizer), for the batching contract's 256-token prompts; each prompt starts with its
request number, so no two share more than the chat template's prefix.
"""
import argparse
import http.client
import json
import threading
import time
import urllib.parse
import urllib.request


def served_model(url):
    """The id the server serves (its /v1/models), which requests must name."""
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        return json.load(resp)["data"][0]["id"]


def one_stream(url, model, prompt, tokens, start, out, index):
    """Streams one chat completion; stores (first token s, last token s, tokens, HTTP status, prompt
    tokens) in out[index]."""
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = json.dumps({"model": model, "stream": True, "max_tokens": tokens, "temperature": 0,
                       "stream_options": {"include_usage": True},
                       "messages": [{"role": "user", "content": prompt}]})
    start.wait()
    t0 = time.time()
    conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first = last = None
    count = prompt_tokens = 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        for choice in chunk.get("choices", []):
            if (choice.get("delta") or {}).get("content"):
                now = time.time() - t0
                first = now if first is None else first
        if chunk.get("usage"):
            count = chunk["usage"]["completion_tokens"]
            prompt_tokens = chunk["usage"]["prompt_tokens"]
    last = time.time() - t0
    out[index] = (first, last, count, resp.status, prompt_tokens)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--prompt-words", type=int, default=0)
    args = ap.parse_args()
    padding = " memory" * args.prompt_words
    start = threading.Event()
    out = [None] * args.streams
    model = served_model(args.url)
    threads = [threading.Thread(target=one_stream, args=(args.url, model, f"Request {i}: tell me about GPUs and memory.{padding}",
                                                        args.tokens, start, out, i)) for i in range(args.streams)]
    for t in threads:
        t.start()
    t0 = time.time()
    start.set()
    for t in threads:
        t.join()
    wall = time.time() - t0
    total = 0
    for i, (first, last, count, status, prompt_tokens) in enumerate(out):
        total += count
        print(f"[streams] request {i}: status {status}, first text {first or float('nan'):.3f} s, "
              f"done {last:.3f} s, {count} tokens after a {prompt_tokens}-token prompt")
    ends = sorted(o[1] for o in out)
    print(f"[streams] {args.streams} streams of {args.tokens} tokens: {total} tokens in {wall:.2f} s = "
          f"{total / wall:.1f} tok/s aggregate; done: first {ends[0]:.3f} s, last {ends[-1]:.3f} s")


if __name__ == "__main__":
    main()
