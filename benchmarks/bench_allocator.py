"""What each allocator choice does to peak reserved memory when sequence lengths vary.

A 6-layer GPT-2-width model (benchmarks/train_gpt.py's) trains on batches whose
sequence length changes every step (seeded, 64..1024 tokens, 16k tokens per batch
at most), under each ``xpt.set_allocator`` kind, each in a fresh process (the
cudaMallocAsync backend can only be chosen before torch is imported). Reported: peak
allocated (what tensors needed), peak reserved (what the allocator took from CUDA),
their ratio, fragmentation at the end, and the step time.

Usage: python benchmarks/bench_allocator.py [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, random, sys, time
sys.path.insert(0, "benchmarks")
import torch, torch.nn.functional as F
import xpuruntime.pytorch as xpt
from train_gpt import GPT
kind, steps = sys.argv[1], int(sys.argv[2])
xpt.set_allocator(kind)
torch.manual_seed(0)
model = GPT(layers=6).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
rng = random.Random(0)
torch.cuda.synchronize(); t0 = time.perf_counter()
for _ in range(steps):
    t = rng.choice([64, 128, 192, 256, 384, 512, 640, 768, 896, 1024])
    b = 16384 // t
    x = torch.randint(0, 50304, (b, t), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), x.view(-1))
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
torch.cuda.synchronize()
s = xpt.allocator_stats()
print(json.dumps({"kind": s.kind, "peak_allocated": s.peak_allocated, "peak_reserved": s.peak_reserved,
                  "fragmentation": s.fragmentation, "ms": (time.perf_counter() - t0) / steps * 1e3}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    rows = []
    for kind in ("default", "expandable_segments", "cuda_malloc_async"):
        env = dict(os.environ)
        if kind == "cuda_malloc_async":
            env["PYTORCH_ALLOC_CONF"] = env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:cudaMallocAsync"
        done = subprocess.run([sys.executable, "-c", CHILD, kind, str(args.steps)],
                              capture_output=True, text=True, env=env)  # fmt: skip
        if done.returncode != 0:
            print(f"{kind}: failed\n{done.stderr[-2000:]}")
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    gib = 2**30
    base = rows[0]["peak_reserved"] if rows else 1
    print(
        "| allocator | peak allocated GiB | peak reserved GiB | reserved / allocated | reserved vs default | fragmentation at end | ms/step |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        frag = "n/a" if r["fragmentation"] is None else f"{r['fragmentation']:.2f}"
        print(
            f"| {r['kind']} | {r['peak_allocated'] / gib:.2f} | {r['peak_reserved'] / gib:.2f} | "
            f"{r['peak_reserved'] / r['peak_allocated']:.2f} | {r['peak_reserved'] / base:.2f} | {frag} | {r['ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
