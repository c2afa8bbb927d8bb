#!/usr/bin/env python3
"""Time to first token of a turn 2 against a running `lily serve`: the prefix cache's payoff.

Sends turn 1 of a chat (a long system message, then a short question), then turn 2 (the same
history + turn 1's answer + a new question), both streamed, greedy, and reports for each the
time to the first generated chunk (content, reasoning or tool call; none when every token was
special), the time to the end of the answer, the prompt tokens and the cached tokens.

With --phases it also reads /metrics before and after each request and prints where the server
spent that request's time (lily_request_phase_seconds_total: parse, template, tokenize, queue,
cache_lookup, new_state, snapshot, prefill, decode, cache_store) and its own time to the first
token; run one client at a time for these to belong to one request. After all conversations it
prints the median of each figure per turn. Standard library only, so it runs on a bare GPU
machine.

  scripts/cache-ttft.py --url http://127.0.0.1:8080 --system-words 3000 --label device-tier
  scripts/cache-ttft.py --url http://127.0.0.1:8080 --system-words 1500 --phases --conversations 5
"""
import argparse
import json
import statistics
import time
import urllib.request

PHASES = ("parse", "template", "tokenize", "queue", "cache_lookup", "new_state", "snapshot", "prefill", "decode",
          "cache_store")


def served_model(url):
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as resp:
        return json.load(resp)["data"][0]["id"]


def server_counters(url):
    """The phase counters and the time-to-first-token sum from /metrics, in seconds."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("lily_request_phase_seconds_total{phase=\""):
            name = line.split('"')[1]
            out[name] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("lily_time_to_first_token_seconds_sum "):
            out["server_ttft"] = float(line.rsplit(" ", 1)[1])
    return out


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
    ap.add_argument("--system-file", help="take the system message's words from this text file (repeated as needed) "
                                          "instead of the synthetic list")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--label", default="")
    ap.add_argument("--conversations", type=int, default=2)
    ap.add_argument("--phases", action="store_true", help="also print the server's phase times of each request")
    ap.add_argument("--pause", type=float, default=0.5,
                    help="seconds between turn 1's answer and turn 2 (a user reading and typing; the server "
                         "prepares memory while idle)")
    args = ap.parse_args()
    model = served_model(args.url)
    if args.system_file:
        with open(args.system_file, encoding="utf-8") as f:
            source = f.read().split()
        words = " ".join(source[i % len(source)] for i in range(args.system_words))
    else:
        words = " ".join(f"w{i % 97} x{i % 13}" for i in range(args.system_words // 2))
    seen = {"turn 1": [], "turn 2": []}  # per turn: {figure: ms} of each conversation

    def measured(messages):
        before = server_counters(args.url) if args.phases else {}
        t, w, answer, u = chat(args.url, model, messages, args.max_tokens)
        after = server_counters(args.url) if args.phases else {}
        delta = {k: 1000 * (after[k] - before.get(k, 0.0)) for k in after}
        return t, w, answer, u, delta

    for c in range(args.conversations):
        system = f"conversation {c}. " + words
        turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise the list."}]
        t1, w1, answer, u1, p1 = measured(turn1)
        turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And again, shorter."}]
        time.sleep(args.pause)
        t2, w2, _, u2, p2 = measured(turn2)
        for name, t, w, u, p in (("turn 1", t1, w1, u1, p1), ("turn 2", t2, w2, u2, p2)):
            cached = ((u or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
            print(f"[ttft] {args.label} conversation {c} {name}: first token {1000 * (t or float('nan')):.1f} ms, "
                  f"whole answer ({args.max_tokens} tokens) {1000 * w:.1f} ms, "
                  f"prompt {(u or {}).get('prompt_tokens')} tokens, cached {cached}", flush=True)
            figures = {"first token": 1000 * t if t is not None else float("nan"), "whole answer": 1000 * w}
            if args.phases:
                figures["server ttft"] = p.get("server_ttft", float("nan"))
                figures.update({k: p.get(k, 0.0) for k in PHASES})
                print(f"[phases] {args.label} conversation {c} {name}: " +
                      ", ".join(f"{k} {p.get(k, 0.0):.2f}" for k in PHASES) +
                      f" ms; server ttft {figures['server ttft']:.2f} ms", flush=True)
            seen[name].append(figures)
    for name, rows in seen.items():
        if not rows:
            continue
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"[median] {args.label} {name} over {len(rows)} conversations: " +
              ", ".join(f"{k} {v:.2f}" for k, v in med.items()) + " ms", flush=True)


if __name__ == "__main__":
    main()
