#!/usr/bin/env python3
"""On the GPU machine: `lily serve --backend cuda` answers chat completions.

Starts `lily serve` on the demo model twice (--backend cpu, then --backend cuda) on a free
loopback port, sends the same requests to each (plain and streamed), and checks that every
answer is a 200 with the OpenAI shape, that the streamed deltas concatenate to the plain answer,
and prints both backends' texts side by side (they agree while the model's margins are large).
Python's standard library only (the GPU machine has no package registry). Exit status 1 on any
failed check.

Usage: scripts/gpu-serve-check.py BUILD/lily models/demo
"""
import json
import re
import subprocess
import sys
import time
import urllib.request

PROMPTS = [
    "What does the --bind option of lily serve do?",
    "Write one sentence about tensors.",
    "Hello",
]


def start_server(lily, model, backend):
    """Starts the server; returns (process, base URL) once /health answers 200."""
    proc = subprocess.Popen(
        [lily, "serve", "--model", model, "--backend", backend, "--bind", "127.0.0.1:0"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    url = None
    deadline = time.time() + 120
    while url is None and time.time() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise RuntimeError(f"{backend} server exited early (status {proc.poll()})")
        sys.stdout.write(f"  [{backend} server] {line}")
        match = re.search(r"listening on (http://[0-9.:]+)", line)
        if match:
            url = match.group(1)
    if url is None:
        raise RuntimeError(f"{backend} server did not print its address")
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, url
        except Exception:
            time.sleep(0.5)
    raise RuntimeError(f"{backend} server never became healthy")


def post(url, body):
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status, r.read().decode()


def chat(url, prompt):
    """Returns (plain text, finish_reason, streamed text); raises on a malformed answer."""
    body = {"model": "demo", "messages": [{"role": "user", "content": prompt}], "max_tokens": 48}
    status, raw = post(url, body)
    assert status == 200, f"status {status}: {raw}"
    answer = json.loads(raw)
    choice = answer["choices"][0]
    assert choice["message"]["role"] == "assistant", raw
    assert answer["usage"]["completion_tokens"] > 0, raw
    status, raw = post(url, dict(body, stream=True))
    assert status == 200, f"status {status}: {raw}"
    events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", raw[-200:]
    streamed = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") or ""
                       for e in events[:-1] if json.loads(e)["choices"])
    return choice["message"]["content"], choice["finish_reason"], streamed


def main():
    lily, model = sys.argv[1], sys.argv[2]
    results, ok = {}, True
    for backend in ("cpu", "cuda"):
        proc, url = start_server(lily, model, backend)
        try:
            for prompt in PROMPTS:
                started = time.time()
                text, finish, streamed = chat(url, prompt)
                seconds = time.time() - started
                same = streamed == text
                ok &= same
                results[(backend, prompt)] = text
                print(f"[{backend}] {prompt!r} -> {finish}, {seconds:.2f} s (plain + stream), "
                      f"stream {'equals' if same else 'DIFFERS FROM'} plain: {text!r}")
        except Exception as e:  # any malformed answer fails the check
            print(f"[{backend}] FAILED: {e}")
            ok = False
        finally:
            proc.terminate()
            status = proc.wait(timeout=30)
            print(f"[{backend}] server exit status after SIGTERM: {status}")
            ok &= status == 0
    for prompt in PROMPTS:
        a, b = results.get(("cpu", prompt)), results.get(("cuda", prompt))
        print(f"cpu vs cuda on {prompt!r}: {'same text' if a == b else 'different text'}")
    print("serve check:", "PASSED" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
