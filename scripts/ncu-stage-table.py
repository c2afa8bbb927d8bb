#!/usr/bin/env python3
"""Per-stage table of one step of the persistent decode kernel's debug form (one launch per stage).

Input: `ncu --csv --page raw --metrics gpu__time_duration.sum --kernel-name regex:decode_stage_kernel
--launch-count 263 ...` of `lily bench --cuda persistent-decode=debug` on the 35B-A3B shape. The
launches of one step come in the order the decode program lists its stages: the embedding, then
per layer the in-projection, the mixer (GDN heads, or attention prepare / splits / combine on
every fourth layer), the out-projection, the router, expert gate/up, expert down; then the LM head
and the argmax. Prints per stage kind: launches, µs per launch, µs per step. Standard library only.

Usage: scripts/ncu-stage-table.py stages.csv [layers=40] [attention_every=4]
"""
import csv
import sys
from collections import OrderedDict


def durations_us(path):
    """Kernel durations in launch order, in µs (the CSV's units row read for the scale)."""
    scale, out = 1e-3, []
    units = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}
    with open(path, newline="") as f:
        lines = [l for l in f if l.startswith('"ID"') or l[:2] == '"' or l.startswith('"')]
    for r in csv.DictReader(lines):
        t = r.get("gpu__time_duration.sum", "")
        if t in units:
            scale = units[t]
            continue
        try:
            out.append(float(t.replace(",", "")) * scale)
        except ValueError:
            continue
    return out


def stage_names(layers, attention_every):
    names = ["embedding"]
    for l in range(layers):
        attn = l % attention_every == attention_every - 1
        kind = "attention" if attn else "GDN"
        names.append(f"{kind} in-projection")
        names += ["attention prepare", "attention splits", "attention combine"] if attn else ["GDN heads"]
        names += [f"{kind} out-projection", "router", "expert gate/up", "expert down"]
    return names + ["LM head", "argmax"]


def main():
    path = sys.argv[1]
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    every = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    names = stage_names(layers, every)
    times = durations_us(path)
    if len(times) < len(names):
        sys.exit(f"{path}: {len(times)} launches, one step has {len(names)}")
    table = OrderedDict()
    for name, t in zip(names, times[: len(names)]):
        n, s = table.get(name, (0, 0.0))
        table[name] = (n + 1, s + t)
    total = sum(s for _, s in table.values())
    print(f"{'stage':28} {'launches':>8} {'us each':>9} {'us/step':>9}")
    for name, (n, s) in table.items():
        print(f"{name:28} {n:8d} {s / n:9.2f} {s:9.1f}")
    print(f"{'total':28} {len(names):8d} {'':9} {total:9.1f}")


if __name__ == "__main__":
    main()
