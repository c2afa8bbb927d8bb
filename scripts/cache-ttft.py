#!/usr/bin/env python3
"""Time to first token of a turn 2 against a running `lily serve`: the prefix cache's payoff.

Sends turn 1 of a chat (a long system message, then a short question), then turn 2 (the same
history + turn 1's answer + a new question), both streamed, greedy, and reports for each the
time to the first generated chunk (content, reasoning or tool call; none when every token was
special), the time to the end of the answer, the prompt tokens and the cached tokens.
Standard library only, so it runs on a bare GPU machine.

  scripts/cache-ttft.py --url http://127.0.0.1:8080 --system-words 3000 --label device-tier
"""
import argparse
import json
import time
import urllib.request


def served_model(url):
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        return json.load(resp)["data"][0]["id"]


def chat(url, model, messages, max_tokens):
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, text, usage = None, "", None
    with urllib.request.urlopen(req, timeout=300) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls")) and first is None:
                    first = time.perf_counter() - t0
                text += delta.get("content") or ""
    return first, time.perf_counter() - t0, text, usage


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--system-words", type=int, default=3000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--label", default="")
    ap.add_argument("--conversations", type=int, default=2)
    args = ap.parse_args()
    model = served_model(args.url)
    words = " ".join(f"w{i % 97} x{i % 13}" for i in range(args.system_words // 2))
    for c in range(args.conversations):
        system = f"conversation {c}. " + words
        turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise the list."}]
        t1, w1, answer, u1 = chat(args.url, model, turn1, args.max_tokens)
        turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And again, shorter."}]
        t2, w2, _, u2 = chat(args.url, model, turn2, args.max_tokens)
        for name, t, w, u in (("turn 1", t1, w1, u1), ("turn 2", t2, w2, u2)):
            cached = ((u or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
            print(f"[ttft] {args.label} conversation {c} {name}: first token {1000 * (t or float('nan')):.1f} ms, "
                  f"whole answer ({args.max_tokens} tokens) {1000 * w:.1f} ms, "
                  f"prompt {(u or {}).get('prompt_tokens')} tokens, cached {cached}", flush=True)


if __name__ == "__main__":
    main()
