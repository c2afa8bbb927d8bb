#!/usr/bin/env python3
"""Golden greedy runs of transformers' Qwen3_5MoeForCausalLM (float32, CPU) on lily checkpoints.

An independent oracle for lily's CPU engine (a second implementation that shares none of its
code): it reads an MLX-layout checkpoint written by `lily synth` (or the demo model) with its own
safetensors parser,
dequantizes every MLX affine tensor exactly (w = scale * q + bias in fp32, docs/model.md
section 2.2), maps the names back to the Hugging Face layout (section 2.3: norm gains stored as
1 + w_hf, conv1d [C, K, 1] -> [C, 1, K], switch_mlp gate/up -> halves of experts.gate_up_proj),
loads them with strict checks, greedy-decodes from the given prompt ids and writes JSON:

  {name, preset, seed, shard_mb, synth_command, checkpoint_fnv1a64, prompt_ids, greedy_ids,
   steps: [{top_k: [[id, logit], ...], margin}], recompute_max_abs_diff,
   transformers_version, torch_version}

steps[i] holds the logits that chose greedy_ids[i] (step 0 = after the prompt); margin is
top-1 minus top-2 logit. recompute_max_abs_diff compares the cached decode's last logits with a
full recompute of the whole sequence (a self-check of the HF cache path).

Usage:
  make_goldens.py --jobs JOBS.json --out-dir DIR
JOBS.json is a list of objects; a golden job has {name, model_dir, preset, seed, shard_mb,
synth_command, prompt_ids, steps}; a demo check has {name, demo_dir, demo_golden} and verifies
that every golden prompt of the demo reproduces its token_ids exactly.
"""
import argparse
import json
import os
import struct
import sys
import time
import traceback

import numpy as np
import torch

TOP_K = 5


# ---- safetensors (own parser) --------------------------------------------------------------

def read_safetensors(path):
    """Returns {name: numpy array}; BF16 is widened exactly to float32."""
    with open(path, "rb") as f:
        data = f.read()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        raw = data[base + start: base + end]
        dtype = info["dtype"]
        shape = info["shape"]
        if dtype == "U32":
            arr = np.frombuffer(raw, dtype="<u4").reshape(shape)
        elif dtype == "F32":
            arr = np.frombuffer(raw, dtype="<f4").reshape(shape)
        elif dtype == "BF16":
            u16 = np.frombuffer(raw, dtype="<u2").reshape(shape)
            arr = (u16.astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"{path}: unexpected dtype {dtype} for {name}")
        out[name] = arr
    return out


def read_checkpoint(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    tensors = {}
    for fn in files:
        for k, v in read_safetensors(os.path.join(model_dir, fn)).items():
            if k in tensors:
                raise ValueError(f"tensor {k} appears in two shards")
            tensors[k] = v
    return tensors


def dequantize(codes, scales, biases):
    """MLX affine: codes U32 [..., out, in*bits/32] -> fp32 [..., out, in]; group 64."""
    in_features = scales.shape[-1] * 64
    bits = 32 * codes.shape[-1] // in_features
    assert bits in (4, 8), bits
    per = 32 // bits
    mask = np.uint32((1 << bits) - 1)
    parts = [(codes >> np.uint32(bits * i)) & mask for i in range(per)]
    q = np.stack(parts, axis=-1).reshape(*codes.shape[:-1], in_features).astype(np.float32)
    s = np.repeat(scales.astype(np.float32), 64, axis=-1)
    b = np.repeat(biases.astype(np.float32), 64, axis=-1)
    return (s * q + b).astype(np.float32), bits


# ---- MLX -> HF name mapping ------------------------------------------------------------------

SHIFTED_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight", "k_norm.weight")


def hf_state_dict(mlx):
    """Maps MLX names/layouts to Qwen3_5MoeForCausalLM's (model.X, lm_head)."""
    quant_bases = sorted(k[: -len(".scales")] for k in mlx if k.endswith(".scales"))
    dense = {}
    for base in quant_bases:
        w, bits = dequantize(mlx[base + ".weight"], mlx[base + ".scales"], mlx[base + ".biases"])
        want8 = base.endswith(".mlp.gate") or base.endswith(".mlp.shared_expert_gate")
        assert bits == (8 if want8 else 4), f"{base}: {bits}-bit"
        dense[base] = w
    used = set()
    for base in quant_bases:
        used.update({base + ".weight", base + ".scales", base + ".biases"})

    def hf_name(mlx_name):
        if mlx_name == "language_model.lm_head":
            return "lm_head"
        assert mlx_name.startswith("language_model.model."), mlx_name
        return "model." + mlx_name[len("language_model.model."):]

    sd = {}
    for base, w in dense.items():
        if ".mlp.switch_mlp." in base:
            continue
        sd[hf_name(base) + ".weight"] = w
    for name, arr in mlx.items():
        if name in used:
            continue
        used.add(name)
        key = hf_name(name)
        a = arr.astype(np.float32)
        if name.endswith("linear_attn.conv1d.weight"):
            a = np.transpose(a, (0, 2, 1)).copy()  # [C, K, 1] -> [C, 1, K]
        elif name.endswith(SHIFTED_NORMS) or name == "language_model.model.norm.weight":
            a = a - np.float32(1.0)  # stored gain = 1 + w_hf (exact in fp32)
        sd[key] = a
    # Experts: switch_mlp gate/up [E, I, H] -> experts.gate_up_proj [E, 2I, H]; down [E, H, I].
    for base in quant_bases:
        if base.endswith(".mlp.switch_mlp.gate_proj"):
            prefix = base[: -len(".switch_mlp.gate_proj")]
            up = dense[prefix + ".switch_mlp.up_proj"]
            sd[hf_name(prefix) + ".experts.gate_up_proj"] = np.concatenate([dense[base], up], axis=1)
            sd[hf_name(prefix) + ".experts.down_proj"] = dense[prefix + ".switch_mlp.down_proj"]
    leftover = set(mlx) - used
    assert not leftover, f"unmapped tensors: {sorted(leftover)[:8]}"
    return sd


def fit_to_model(sd, model):
    """Strict load: same key set, same shapes (transposing expert stacks only if the installed
    transformers stores them [E, in, out]); returns the torch state dict."""
    target = model.state_dict()
    missing = sorted(set(target) - set(sd))
    unexpected = sorted(set(sd) - set(target))
    if missing or unexpected:
        raise KeyError(f"missing {missing[:10]} ({len(missing)}), unexpected {unexpected[:10]} ({len(unexpected)})")
    out = {}
    for k, v in sd.items():
        want = tuple(target[k].shape)
        if tuple(v.shape) != want:
            if k.endswith(("experts.gate_up_proj", "experts.down_proj")) and tuple(np.swapaxes(v, 1, 2).shape) == want:
                v = np.ascontiguousarray(np.swapaxes(v, 1, 2))
            else:
                raise ValueError(f"{k}: shape {v.shape}, model wants {want}")
        out[k] = torch.from_numpy(np.ascontiguousarray(v))
    return out


# ---- model ---------------------------------------------------------------------------------

def build_model(model_dir):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    text = dict(cfg["text_config"])
    text.pop("model_type", None)
    config = Qwen3_5MoeTextConfig(**text)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen3_5MoeForCausalLM(config).to(torch.float32).eval()
    sd = fit_to_model(hf_state_dict(read_checkpoint(model_dir)), model)
    result = model.load_state_dict(sd, strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    return model


@torch.no_grad()
def greedy(model, prompt_ids, steps, record=True):
    out = model(input_ids=torch.tensor([prompt_ids], dtype=torch.long), use_cache=True)
    past = out.past_key_values
    logits = out.logits[0, -1].float()
    ids, recs = [], []
    for i in range(steps):
        top = torch.topk(logits, TOP_K)
        nxt = int(torch.argmax(logits))  # first maximal index = lowest id on ties
        if record:
            vals = top.values.tolist()
            recs.append({"top_k": [[int(t), float(v)] for t, v in zip(top.indices.tolist(), vals)],
                         "margin": float(vals[0] - vals[1])})
        ids.append(nxt)
        if i + 1 == steps:
            break
        out = model(input_ids=torch.tensor([[nxt]], dtype=torch.long), past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits = out.logits[0, -1].float()
    # Self-check: the cached path's last logits against a full recompute of the sequence.
    full = model(input_ids=torch.tensor([list(prompt_ids) + ids[:-1]], dtype=torch.long), use_cache=False)
    diff = float((full.logits[0, -1].float() - logits).abs().max())
    return ids, recs, diff


def run_golden(job, out_dir):
    import transformers
    t0 = time.time()
    model = build_model(job["model_dir"])
    ids, steps, diff = greedy(model, job["prompt_ids"], job["steps"])
    golden = {
        "name": job["name"],
        "preset": job["preset"],
        "seed": job["seed"],
        "shard_mb": job.get("shard_mb", -1),
        "synth_command": job["synth_command"],
        "checkpoint_fnv1a64": job.get("checkpoint_fnv1a64"),
        "prompt_ids": job["prompt_ids"],
        "greedy_ids": ids,
        "steps": steps,
        "recompute_max_abs_diff": diff,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
    }
    with open(os.path.join(out_dir, job["name"] + ".golden.json"), "w") as f:
        json.dump(golden, f, indent=1)
    margins = [s["margin"] for s in steps]
    print(f"{job['name']}: {len(ids)} ids, min margin {min(margins):.4g}, recompute diff {diff:.3g}, "
          f"{time.time() - t0:.1f}s", flush=True)


def run_demo_check(job, out_dir):
    model = build_model(job["demo_dir"])
    with open(job["demo_golden"]) as f:
        demo = json.load(f)
    ok = True
    report = []
    for g in demo["goldens"]:
        want = g["token_ids"]
        got, _, diff = greedy(model, g["prompt_ids"], len(want), record=False)
        same = got == want
        ok &= same
        first_bad = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        report.append({"prompt_len": len(g["prompt_ids"]), "n": len(want), "identical": same,
                       "first_mismatch": first_bad, "recompute_diff": diff})
        print(f"demo: {len(want)} ids identical={same} first_mismatch={first_bad} recompute {diff:.3g}", flush=True)
    with open(os.path.join(out_dir, job["name"] + ".json"), "w") as f:
        json.dump({"all_identical": ok, "prompts": report}, f, indent=1)
    print(f"DEMO {'OK' if ok else 'MISMATCH'}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", required=True)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(args.jobs) as f:
        jobs = json.load(f)
    failed = 0
    for job in jobs:
        try:
            if "demo_dir" in job:
                run_demo_check(job, args.out_dir)
            else:
                run_golden(job, args.out_dir)
        except Exception:
            failed += 1
            print(f"JOB {job['name']} FAILED", flush=True)
            traceback.print_exc()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
