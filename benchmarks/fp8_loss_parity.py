"""FP8 against bf16 on real text: the Llama-3.2-1B shape trained from scratch on the
bytes of Python's standard library (its own ``.py`` sources: real text on a machine
without a network), the same initial weights and batches for every mode, and the loss
curves side by side (GPU with FP8: compute capability 8.9 or newer).

Modes: ``bf16`` (``optimize(model)``), ``fp8`` and ``fp8_rowwise`` (``optimize(model,
{"precision": ...})``); a mode with ``@N`` starts from the initial weights of seed ``N``
(default 0), so that ``bf16@1`` measures how far two bf16 runs drift apart by chance:
the floor against which the FP8 curves' distance from ``bf16`` reads. ``eager`` is
transformers' own bf16 step without ``optimize``, from the same weights. It shows how
far a change of rounding alone (other kernels, one precision) moves the curve. A mode with
``+act`` (``fp8+act``) also keeps the gated MLPs' gate and up in FP8 for the backward
(the policy's ``fp8_activations``). Byte-level tokens
(vocabulary 256), B4 x T2048, bf16 autocast, AdamW (fused; lr 3e-4 after 30 steps of
warm-up, cosine to 3e-5), fp32 parameters. Every 20th source file is held out: each 25
steps every mode's loss on the same 16 held-out rows (no gradient) is measured as well
as its training loss. Prints both every 25 steps, the training loss's mean over the last
25 steps and each FP8 curve's largest distance from bf16's after step 50 (the training
loss as 25-step means; the held-out loss at each measurement), each against bf16 of its
seed. One run's distance is as much chance as precision: transformers' own bf16 kernels
ended 1.6% from ours at one seed. ``--seeds`` runs every mode at each seed, and compares
the curves averaged over them as well. ``--out FILE`` writes the curves as JSON;
``--compare`` prints the same comparisons over saved files (runs of several calls
merged, each seed's in its own), ``--plot`` draws them (several seeds: their means).

``--lora``: LoRA's frozen base in FP8. The model is trained in bf16 first (``--pretrain``
steps on the standard library), then cast to bf16 as LoRA users load a model, and LoRA
(r=16, alpha 32, on every projection, the same initial adapters) is tuned over it on
other code, the installed packages' sources (site-packages, up to 64 MB, every 20th file
held out), for ``--steps`` steps, lr 1e-3, in each of ``bf16``, ``fp8`` (the base's
GEMMs in FP8, the weight cast per call) and ``fp8_base`` (the base stored in FP8), and
``fp8_base+act`` (gate and up kept in FP8 as well).

    python benchmarks/fp8_loss_parity.py --steps 500 --modes bf16,fp8,fp8_rowwise,bf16@1 --out curves.json
    python benchmarks/fp8_loss_parity.py --steps 500 --modes bf16,fp8_rowwise --seeds 0,1,2
    python benchmarks/fp8_loss_parity.py --lora --pretrain 300 --steps 200 --out lora.json
    python benchmarks/fp8_loss_parity.py --compare seed0.json seed1.json seed2.json   # anywhere
    python benchmarks/fp8_loss_parity.py --plot docs/images/fp8_loss.png seed0.json seed1.json seed2.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import sysconfig
import time

MODES = ("bf16", "fp8", "fp8_rowwise", "bf16@1")
SHAPE = {  # Llama-3.2-1B's decoder, byte tokens
    "vocab_size": 256, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": True,
    "rope_theta": 500000.0, "max_position_embeddings": 8192,
}  # fmt: skip
EVERY = 25  # steps between held-out measurements
HELD_OUT_ROWS = 16


def corpus() -> tuple[bytes, bytes]:
    """The standard library's Python sources in a fixed order: (training, held out),
    every 20th file held out."""
    return _split(sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")))


def packages(limit: int = 64 << 20) -> tuple[bytes, bytes]:
    """The installed packages' Python sources (site-packages: other code than the
    standard library's), in a fixed order up to ``limit`` bytes: (tuning, held out)."""
    files, total = [], 0
    for path in sorted(pathlib.Path(sysconfig.get_paths()["purelib"]).rglob("*.py")):
        files.append(path)
        total += path.stat().st_size
        if total > limit:
            break
    return _split(files)


def _split(files: list[pathlib.Path]) -> tuple[bytes, bytes]:
    train = b"\n".join(p.read_bytes() for i, p in enumerate(files) if i % 20)
    held = b"\n".join(p.read_bytes() for i, p in enumerate(files) if not i % 20)
    return train, held


def _rows(text, starts, seq):
    import torch

    return torch.stack([text[s : s + seq] for s in starts]).cuda()


def _tokens(text: bytes):
    import torch

    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


def _llama(seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device("cuda"):
        return LlamaForCausalLM(LlamaConfig(**SHAPE, use_cache=False))


def train(mode: str, steps: int, batch: int, seq: int) -> dict:
    """``mode`` (``precision[@seed]``) trained from scratch on the standard library."""
    from xpuruntime import pytorch as xpt

    precision, _, seed = mode.partition("@")
    model = _llama(int(seed or 0))  # the same initial weights, unless asked otherwise
    if precision == "eager":
        return _run(mode, model, list(model.parameters()), steps, batch, seq, corpus(), 3e-4)
    precision, _, act = precision.partition("+")
    policy = {"precision": precision, **({"fp8_activations": True} if act else {})}
    report = xpt.optimize(model, None if precision == "bf16" else policy)
    try:
        return _run(mode, model, list(model.parameters()), steps, batch, seq, corpus(), 3e-4)
    finally:
        report.revert()


TUNED = ("bf16", "fp8", "fp8_base")
"""``--lora``'s modes: the base in bf16, its GEMMs in FP8 (cast per call), stored in FP8
(and ``fp8_base+act``: gate and up kept in FP8 as well)."""


def tune(mode: str, state: dict, steps: int, batch: int, seq: int) -> dict:
    """LoRA (r=16 on every projection, bf16 base as LoRA users load it) over the weights
    ``state``, tuned on the installed packages' sources, the base per ``mode``."""
    import torch
    from peft import LoraConfig, get_peft_model

    from xpuruntime import pytorch as xpt

    model = _llama(0)
    model.load_state_dict(state)
    model.to(torch.bfloat16)
    torch.manual_seed(1)  # the same adapters for every mode
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    policy = {
        None: None,
        "fp8": {"precision": "fp8"},
        "fp8_base": {"precision": "fp8", "fp8_base": True},
        "fp8_base+act": {"precision": "fp8", "fp8_base": True, "fp8_activations": True},
    }
    report = xpt.optimize(model, policy[None if mode == "bf16" else mode])
    adapters = [p for p in model.parameters() if p.requires_grad]
    try:
        return _run(mode, model, adapters, steps, batch, seq, packages(), 1e-3)
    finally:
        report.revert()


def _run(mode, model, trained, steps, batch, seq, texts, lr) -> dict:
    """``steps`` of AdamW over ``trained`` on ``texts`` (training, held out): the loss
    each step, the held-out loss each ``EVERY`` steps, the step time after the tenth."""
    import torch

    text, held = (_tokens(t) for t in texts)
    generator = torch.Generator().manual_seed(0)  # the same batches for every mode
    starts = torch.randint(0, len(text) - seq - 1, (steps, batch), generator=generator)
    held_starts = torch.randint(0, len(held) - seq - 1, (HELD_OUT_ROWS,), generator=generator)
    held_ids = _rows(held, held_starts, seq)
    optimizer = torch.optim.AdamW(trained, lr=lr, weight_decay=0.1, fused=True)

    def rate(step: int) -> float:  # warm-up, then cosine to a tenth
        if step < 30:
            return (step + 1) / 30
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - 30) / max(1, steps - 30)))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate)

    def held_out() -> float:
        model.eval()
        total = 0.0
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for part in held_ids.split(batch):
                total += model(input_ids=part, labels=part).loss.item() * len(part)
        model.train()
        return total / len(held_ids)

    losses, evals, seconds = [], [], 0.0
    for step in range(steps):
        begin = time.perf_counter()  # (timed from step 10 on: the first compile kernels)
        ids = _rows(text, starts[step], seq)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step >= 10:
            seconds += time.perf_counter() - begin
        if (step + 1) % EVERY == 0:
            evals.append(held_out())
            print(f"{mode} step {step + 1}: train {losses[-1]:.4f}, held out {evals[-1]:.4f}",
                  flush=True)  # fmt: skip
    ms = seconds / max(1, steps - 10) * 1e3
    print(f"{mode}: {ms:.1f} ms/step", flush=True)
    return {"train": losses, "held_out": evals, "ms": ms}


def means(xs: list[float], n: int) -> list[float]:
    """Means of ``n`` consecutive steps."""
    return [sum(xs[i : i + n]) / n for i in range(0, len(xs) - n + 1, n)]


def plot(curves: dict, path: str) -> None:
    """Each run's training loss (every step, thin, and 25-step means) and held-out loss;
    runs of several seeds as each precision's distance from bf16 (:func:`plot_distances`)."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, title = curves["runs"], curves.get("title", "FP8 against bf16")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    seeds = _seeds(runs)
    if len(seeds) > 1 and "bf16" in seed_means(runs, seeds):  # (else each run's curves)
        plot_distances(runs, seeds, left, right)
        title += f", seeds {','.join(seeds)}"
    else:
        for mode, run in runs.items():
            (line,) = left.plot(range(1, len(run["train"]) + 1), run["train"], linewidth=0.5,
                                alpha=0.35)  # fmt: skip
            smooth = means(run["train"], EVERY)
            left.plot([EVERY * (i + 1) for i in range(len(smooth))], smooth, label=mode,
                      color=line.get_color(), linewidth=1.5)  # fmt: skip
            right.plot([EVERY * (i + 1) for i in range(len(run["held_out"]))], run["held_out"],
                       label=mode, color=line.get_color(), marker=".")  # fmt: skip
        left.set_title("training loss (each step, and 25-step means)", fontsize=9)
        right.set_title("held-out loss (every 20th file, 16 rows)", fontsize=9)
        for ax in (left, right):
            ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
        left.set_ylabel("loss per byte of Python source")
    for ax in (left, right):
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 120), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_distances(runs: dict, seeds: list[str], left, right) -> None:
    """Each precision's distance from bf16 in percent, after step 50: its mean over
    ``seeds`` against bf16's (bold) and each seed's run against bf16 of that seed (thin);
    the training loss as 25-step means (``left``), the held-out loss (``right``)."""
    mean = seed_means(runs, seeds)
    base = {"train": means(mean["bf16"][0], EVERY), "held_out": mean["bf16"][1]}
    for precision, (train, held) in mean.items():
        if precision == "bf16":
            continue
        color = None
        for seed in seeds:  # (each run against bf16 of its own seed)
            own, ref = runs[_named(precision, seed, runs)], runs[_named("bf16", seed, runs)]
            for ax, curve, against in (
                (left, means(own["train"], EVERY), means(ref["train"], EVERY)),
                (right, own["held_out"], ref["held_out"]),
            ):
                (line,) = ax.plot(*_apart(curve, against), linewidth=0.7, alpha=0.45,
                                  color=color)  # fmt: skip
                color = line.get_color()
        for ax, curve, key in ((left, means(train, EVERY), "train"), (right, held, "held_out")):
            ax.plot(*_apart(curve, base[key]), color=color, linewidth=2.0, marker=".",
                    label=f"{precision}: mean of {len(seeds)} seeds (thin: each seed)")  # fmt: skip
    for ax in (left, right):
        ax.axhline(0.0, color="black", linewidth=0.6)
        for bound in (-2.0, 2.0):
            ax.axhline(bound, color="grey", linewidth=0.6, linestyle="--")
    left.set_title("training loss (25-step means) against bf16's", fontsize=9)
    right.set_title("held-out loss against bf16's", fontsize=9)
    left.set_ylabel("distance from bf16, % (dashed: the 2% bound)")


def _apart(curve: list[float], against: list[float]) -> tuple[list[int], list[float]]:
    """``curve``'s distance from ``against`` in percent at each measurement after step
    50 (the steps, the distances)."""
    points = list(zip(curve, against))[2:]
    steps = [EVERY * (i + 3) for i in range(len(points))]
    return steps, [100.0 * (a - b) / b for a, b in points]


def summary(runs: dict) -> None:
    names = list(runs)
    print(
        "| step | " + " | ".join(f"{m} train (25-step mean) | {m} held out" for m in names) + " |"
    )
    print("| ---: |" + " ---: | ---: |" * len(names))
    smooth = {m: means(r["train"], EVERY) for m, r in runs.items()}
    for i in range(len(smooth[names[0]])):
        cells = " | ".join(f"{smooth[m][i]:.4f} | {runs[m]['held_out'][i]:.4f}" for m in names)
        print(f"| {EVERY * (i + 1)} | {cells} |")
    for mode, run in runs.items():
        ref = _reference(mode, runs)
        if ref is None:
            continue
        last, final, train_apart, held_apart = distances(smooth[mode], run["held_out"],
                                                         smooth[ref], runs[ref]["held_out"])  # fmt: skip
        print(f"{mode} against {ref}: {run['ms']:.1f} against {runs[ref]['ms']:.1f} ms/step; "
              f"last 25 steps' training loss {last:+.2%}, last held-out {final:+.2%}; "
              f"largest distance after step 50: training (25-step means) {train_apart:.2%}, "
              f"held out {held_apart:.2%}")  # fmt: skip
    seeds = _seeds(runs)
    if len(seeds) < 2:
        return
    # Over several seeds: each precision's curves averaged over its seeds, against bf16's.
    mean = {precision: (means(train, EVERY), held)
            for precision, (train, held) in seed_means(runs, seeds).items()}  # fmt: skip
    if "bf16" not in mean:
        return
    for precision, (train, held) in mean.items():
        if precision != "bf16":
            last, final, train_apart, held_apart = distances(train, held, *mean["bf16"])
            print(f"{precision} against bf16, means over seeds {','.join(seeds)}: last 25 "
                  f"steps' training loss {last:+.2%}, last held-out {final:+.2%}; largest "
                  f"distance after step 50: training {train_apart:.2%}, held out "
                  f"{held_apart:.2%}")  # fmt: skip


def _seeds(runs: dict) -> list[str]:
    """The seeds the runs started from."""
    return sorted({m.partition("@")[2] or "0" for m in runs})


def seed_means(runs: dict, seeds: list[str]) -> dict[str, tuple[list[float], list[float]]]:
    """Each precision that ran at every one of ``seeds``: its training loss at each step
    and its held-out losses, averaged over those seeds."""
    mean = {}
    for precision in dict.fromkeys(m.partition("@")[0] for m in runs):
        group = [_named(precision, seed, runs) for seed in seeds]
        if None not in group:
            mean[precision] = (_averaged([runs[m]["train"] for m in group]),
                               _averaged([runs[m]["held_out"] for m in group]))  # fmt: skip
    return mean


def merged(paths: list[str]) -> dict:
    """The curves of several ``--out`` files as one (each run named once; the first
    file's title)."""
    runs, title = {}, None
    for path in paths:
        curves = json.loads(pathlib.Path(path).read_text())
        twice = sorted(set(runs) & set(curves["runs"]))
        if twice:
            raise SystemExit(f"{path}: runs {twice} are in an earlier file as well")
        runs.update(curves["runs"])
        title = title or curves.get("title")
    return {"title": title or "FP8 against bf16", "runs": runs}


def _averaged(curves: list[list[float]]) -> list[float]:
    """The curves' mean at each point."""
    return [sum(points) / len(points) for points in zip(*curves)]


def _reference(mode: str, runs: dict) -> str | None:
    """The bf16 run ``mode`` is read against: bf16 of its seed (``bf16@1`` for
    ``fp8@1``), seed 0's for a bf16 run of another seed (bf16's own spread); None where
    that did not run, or for the reference itself."""
    precision, _, seed = mode.partition("@")
    ref = _named("bf16", "0" if precision == "bf16" else seed or "0", runs)
    return None if ref == mode else ref


def _named(precision: str, seed: str, runs: dict) -> str | None:
    """The run of ``precision`` at ``seed`` (seed 0's named with ``@0`` or without)."""
    names = (f"{precision}@{seed}", precision) if seed == "0" else (f"{precision}@{seed}",)
    return next((n for n in names if n in runs), None)


def distances(train, held, base_train, base_held) -> tuple[float, float, float, float]:
    """A curve against a reference: the last 25-step mean's and the last held-out loss's
    relative difference, and the largest distance after step 50 of each (the 25-step
    means from the third on, the held-out losses likewise)."""
    last = (train[-1] - base_train[-1]) / base_train[-1]
    final = (held[-1] - base_held[-1]) / base_held[-1]
    train_apart = max((abs(a - b) / b for a, b in zip(train[2:], base_train[2:])), default=0.0)
    held_apart = max((abs(a - b) / b for a, b in zip(held[2:], base_held[2:])), default=0.0)
    return last, final, train_apart, held_apart


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--modes", default="", help=f"default {','.join(MODES)}; with --lora "
                        f"{','.join(TUNED)}")  # fmt: skip
    parser.add_argument("--seeds", default="", help="run each mode at each of these seeds "
                        "(from scratch): the curves averaged over them are compared too")  # fmt: skip
    parser.add_argument("--lora", action="store_true", help="LoRA over a bf16-trained model")
    parser.add_argument("--pretrain", type=int, default=300, help="with --lora: its bf16 steps")
    parser.add_argument("--out", help="write the curves here (JSON)")
    parser.add_argument("--plot", nargs="+", metavar="PNG JSON",
                        help="draw saved curves (several files merged; several seeds: their "
                        "means)")  # fmt: skip
    parser.add_argument("--compare", nargs="+", metavar="JSON",
                        help="print the table and distances of saved curves (several files "
                        "merged: runs of several calls, as --seeds would)")  # fmt: skip
    args = parser.parse_args()
    if args.plot:
        if len(args.plot) < 2:
            parser.error("--plot takes a PNG path, then one or more JSON files")
        plot(merged(args.plot[1:]), args.plot[0])
        return
    if args.compare:
        summary(merged(args.compare)["runs"])
        return
    import torch

    shape = (
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, Llama-1B shape, "
        f"B{args.batch} x T{args.seq}"
    )
    title = f"{shape}, {args.steps} steps"
    if args.lora:
        title = (f"{shape}, {args.pretrain} steps in bf16 on the standard library, then LoRA "
                 f"r=16 over it for {args.steps} steps on site-packages' sources")  # fmt: skip
    print(f"# {title}")
    if args.lora:
        trained = _llama(0)
        from xpuruntime import pytorch as xpt

        report = xpt.optimize(trained)
        _run("bf16 (pretraining)", trained, list(trained.parameters()), args.pretrain,
             args.batch, args.seq, corpus(), 3e-4)  # fmt: skip
        report.revert()
        state = {k: v.detach().clone() for k, v in trained.state_dict().items()}
        del trained
        modes = args.modes.split(",") if args.modes else TUNED
        run = functools.partial(tune, state=state)
    else:
        modes = (args.modes or ",".join(MODES)).split(",")
        if args.seeds:
            modes = [f"{m}@{seed}" for seed in args.seeds.split(",") for m in modes]
        run = train
    runs = {}
    for mode in modes:  # (the curves written as each mode ends: a cut-short call keeps them)
        runs[mode] = run(mode, steps=args.steps, batch=args.batch, seq=args.seq)
        if args.out:
            pathlib.Path(args.out).write_text(json.dumps({"title": title, "runs": runs}))
    summary(runs)


if __name__ == "__main__":
    main()
