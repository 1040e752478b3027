"""FP8 against bf16 on real text: the Llama-3.2-1B shape trained from scratch on the
bytes of Python's standard library (its own ``.py`` sources: real text on a machine
without a network), the same initial weights and batches for every mode, and the loss
curves side by side (GPU with FP8: compute capability 8.9 or newer).

Modes: ``bf16`` (``optimize(model)``), ``fp8`` and ``fp8_rowwise`` (``optimize(model,
{"precision": ...})``). Byte-level tokens (vocabulary 256), B4 x T2048, bf16 autocast,
AdamW (lr 3e-4 after 30 steps of warm-up, fused), fp32 parameters. Prints the loss every
25 steps, the mean of the last 25, and each FP8 curve's largest distance from bf16's
after step 50; ``--out FILE`` writes the curves as JSON (``--plot FILE`` draws them).

    python benchmarks/fp8_loss_parity.py --steps 300 --out curves.json
    python benchmarks/fp8_loss_parity.py --plot docs/fp8_loss.png curves.json   # anywhere
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sysconfig
import time

MODES = ("bf16", "fp8", "fp8_rowwise")
SHAPE = {  # Llama-3.2-1B's decoder, byte tokens
    "vocab_size": 256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True,
    "rope_theta": 500000.0, "max_position_embeddings": 8192,
}  # fmt: skip


def corpus() -> bytes:
    """The standard library's Python sources, in a fixed order."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return b"\n".join(p.read_bytes() for p in sorted(root.rglob("*.py")))


def train(mode: str, steps: int, batch: int, seq: int) -> list[float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from xpuruntime import pytorch as xpt

    text = torch.frombuffer(bytearray(corpus()), dtype=torch.uint8).long()
    generator = torch.Generator().manual_seed(0)  # the same batches for every mode
    starts = torch.randint(0, len(text) - seq - 1, (steps, batch), generator=generator)
    torch.manual_seed(0)  # the same initial weights
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**SHAPE, use_cache=False))
    report = xpt.optimize(model, None if mode == "bf16" else {"precision": mode})
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 30))
    losses = []
    begin = time.perf_counter()
    for step in range(steps):
        ids = torch.stack([text[s : s + seq] for s in starts[step]]).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        warmup.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    seconds = (time.perf_counter() - begin) / steps
    report.revert()
    print(f"{mode}: {seconds * 1e3:.1f} ms/step", flush=True)
    return losses


def plot(curves: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, losses in curves["losses"].items():
        ax.plot(range(1, len(losses) + 1), losses, label=mode, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (bytes of Python's standard library)")
    ax.set_title(curves.get("title", "FP8 against bf16"), fontsize=9)
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--out", help="write the curves here (JSON)")
    parser.add_argument("--plot", nargs=2, metavar=("PNG", "JSON"), help="draw saved curves")
    args = parser.parse_args()
    if args.plot:
        plot(json.loads(pathlib.Path(args.plot[1]).read_text()), args.plot[0])
        return
    import torch

    title = (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Llama-1B shape, "
        f"B{args.batch} x T{args.seq}, {args.steps} steps"
    )
    print(f"# {title}")
    curves = {mode: train(mode, args.steps, args.batch, args.seq) for mode in args.modes.split(",")}
    print("| step | " + " | ".join(curves) + " |")
    print("| ---: |" + " ---: |" * len(curves))
    for step in range(24, args.steps, 25):
        print(f"| {step + 1} | " + " | ".join(f"{c[step]:.4f}" for c in curves.values()) + " |")
    last = {mode: sum(c[-25:]) / len(c[-25:]) for mode, c in curves.items()}
    print("mean of the last 25: " + ", ".join(f"{m} {v:.4f}" for m, v in last.items()))
    if "bf16" in curves:
        base = curves["bf16"]
        for mode, c in curves.items():
            if mode == "bf16":
                continue

            # The curves' distance after step 50, each as a moving mean of 10 steps.
            def smooth(xs):
                return [sum(xs[i - 9 : i + 1]) / 10 for i in range(59, len(xs))]

            apart = max(abs(a - b) / b for a, b in zip(smooth(c), smooth(base)))
            final = (last[mode] - last["bf16"]) / last["bf16"]
            print(f"{mode} against bf16: last 25 steps {final:+.2%}; "
                  f"largest distance after step 50 (10-step means) {apart:.2%}")  # fmt: skip
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps({"title": title, "losses": curves}))


if __name__ == "__main__":
    main()
