#!/usr/bin/env python3
"""Per-kernel table of one decode step from an Nsight Compute CSV export.

Input: `ncu --import prof.ncu-rep --csv --page raw --metrics gpu__time_duration.sum` of a
`lily generate --backend cuda` run (prefill, then decode steps). Every step ends with the argmax
kernels, so the kernel sequence is cut after each run of argmax kernels; the last complete step is
tabulated by kernel name (calls, µs per call, µs total, share), sorted by total. Python standard
library only (the GPU machine has no package registry).

Usage: scripts/ncu-decode-table.py prof.csv            # the last decode step
       scripts/ncu-decode-table.py --prefill prof.csv  # the first segment: the prompt's prefill
                                                       # (with any load-time kernels) and its argmax
"""
import csv
import sys
from collections import OrderedDict


def load(path):
    """[(kernel name, ns)] in launch order; the units row and non-kernel rows are skipped."""
    rows, scale = [], 1.0
    units = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6, "second": 1e9, "s": 1e9}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        for r in reader:
            name = r.get("Kernel Name") or r.get("Function Name") or ""
            t = r.get("gpu__time_duration.sum", "")
            if t in units:
                scale = units[t]  # the units row
                continue
            try:
                v = float(t.replace(",", "")) * scale
            except ValueError:
                continue
            rows.append((name, v))
    return rows


def steps(rows):
    """Segments of the sequence, each ending with a run of argmax kernels."""
    out, cur, in_argmax = [], [], False
    for name, v in rows:
        is_arg = "argmax" in name
        if in_argmax and not is_arg:
            out.append(cur)
            cur = []
        cur.append((name, v))
        in_argmax = is_arg
    if cur and in_argmax:
        out.append(cur)
    return out


def short(name):
    """The kernel name without namespaces and argument lists, templates kept."""
    n = name.split("(")[0]
    return n.replace("lily::cuda::", "").replace("(anonymous namespace)::", "").replace("void ", "")


def main():
    prefill = "--prefill" in sys.argv[1:]
    paths = [a for a in sys.argv[1:] if a != "--prefill"]
    rows = load(paths[0])
    segs = steps(rows)
    if len(segs) < (1 if prefill else 2):
        print(f"no {'prefill' if prefill else 'decode step'} found ({len(rows)} kernels, {len(segs)} segments)")
        return 1
    step = segs[0] if prefill else segs[-1]
    agg = OrderedDict()
    for name, v in step:
        k = short(name)
        c, t = agg.get(k, (0, 0.0))
        agg[k] = (c + 1, t + v)
    total = sum(t for _, t in agg.values())
    what = "The prefill" if prefill else "One decode step"
    print(f"{what}: {len(step)} kernels, {total / 1e3:.1f} µs of kernel time "
          f"(each kernel alone, caches as ncu leaves them); {len(segs) - 1} decode steps profiled.\n")
    print("| kernel | calls | µs per call | µs total | share |")
    print("|---|---|---|---|---|")
    for k, (c, t) in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        print(f"| `{k[:80]}` | {c} | {t / c / 1e3:.2f} | {t / 1e3:.1f} | {100 * t / total:.1f} % |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
