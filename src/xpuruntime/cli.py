"""The ``xpuruntime`` command: devices, run, bench, compare, policy, demo."""

from __future__ import annotations

import argparse
import importlib.resources
import json
import math
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.markup import escape

from ._errors import InvalidInputError, XpuRuntimeError

__all__ = ["demo_model_path", "main"]

PIPED_WIDTH = 200
MAX_BENCH_SECONDS = 3600.0
MAX_BENCH_RUNS = 100_000
MAX_CONCURRENCY = 1024
MAX_GENERATED_ELEMENTS = 2**28
"""Elements one generated input may have (1 GiB of float32)."""


def demo_model_path() -> Path:
    """The small CNN (``image[batch,3,32,32] -> probabilities[batch,10]``) shipped inside
    the package for the demo and the examples."""
    return Path(str(importlib.resources.files("xpuruntime") / "models" / "demo_cnn.onnx"))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``xpuruntime`` command; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    from rich.console import Console

    # Piped output keeps whole lines (a terminal's width, else a wide page) and cells
    # wrap rather than being cut.
    width = None if sys.stdout.isatty() else PIPED_WIDTH
    console, errors = Console(width=width), Console(stderr=True, width=width)

    def show_warning(message, category, *_args, **_kwargs) -> None:
        # One line per warning: the library also logs it, but logging is silent here.
        errors.print(f"[yellow]{category.__name__}[/]: {escape(str(message))}", highlight=False)

    with warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = show_warning
        try:
            return args.command(args, console) or 0
        except XpuRuntimeError as e:
            errors.print(f"[bold red]{type(e).__name__}[/]: {escape(str(e))}", highlight=False)
            return 2


# -- arguments -----------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="xpuruntime", description=__doc__.replace("``", ""))
    parser.add_argument("--version", action="version", version=f"xpuruntime {__version__}")
    sub = parser.add_subparsers(required=True, metavar="COMMAND")

    p = sub.add_parser("devices", help="list devices and backends")
    p.set_defaults(command=_devices)

    for name, fn, text in (
        ("run", _run, "run a model once and summarise its outputs"),
        ("bench", _bench, "latency and throughput per engine"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("model", type=Path)
        _session_args(p, engines=(name == "bench"))
        p.set_defaults(command=fn)
        if name == "run":
            p.add_argument(
                "--input",
                action="append",
                default=[],
                metavar="FILE",
                help=".npz (name -> array) or NAME=FILE.npy; repeatable",
            )
            p.add_argument("--explain", action="store_true", help="print the engine decision")
        else:
            p.add_argument(
                "--seconds",
                type=_seconds,
                default=1.0,
                help=f"time per engine (at most {MAX_BENCH_SECONDS:g})",
            )
            p.add_argument(
                "--calibration",
                type=Path,
                default=None,
                metavar="DIR_OR_NPZ",
                help="calibration batches for --precision int8/auto: an .npz whose arrays "
                "(named as the inputs) stack the batches on a leading axis, or a folder of "
                ".npz files, one batch each (the last fifth is held out to judge accuracy)",
            )
            p.add_argument(
                "--performance",
                choices=["latency", "throughput"],
                default=None,
                help="what the engines are tuned for (policy field 'performance')",
            )
            p.add_argument(
                "--concurrency",
                type=_concurrency,
                default=1,
                help="requests kept in flight (run_async); 1 times one run after another",
            )
            p.add_argument(
                "--json", type=Path, default=None, metavar="FILE", help="also write the report"
            )

    p = sub.add_parser("compare", help="cross-engine accuracy against ONNX Runtime CPU fp32")
    p.add_argument("model", type=Path)
    _session_args(p, engines=True)
    p.add_argument("--rtol", type=float, default=1e-3)
    p.add_argument("--atol", type=float, default=1e-4)
    p.set_defaults(command=_compare)

    p = sub.add_parser("policy", help="show or validate a kernel or execution policy file")
    p.add_argument("action", choices=["show", "validate"])
    p.add_argument("file", type=Path)
    p.set_defaults(command=_policy)

    p = sub.add_parser("demo", help="the bundled model on every available engine")
    p.add_argument("--seconds", type=_seconds, default=0.5, help="time per engine")
    p.set_defaults(command=_demo)
    return parser


def _session_args(p: argparse.ArgumentParser, *, engines: bool) -> None:
    if engines:
        p.add_argument(
            "--engines",
            default=None,
            help="comma-separated engine names (default: all that run on the device)",
        )
    else:
        p.add_argument("--engine", default=None, help="engine name or 'auto'")
    p.add_argument("--device", default=None, help="cpu, cuda[:N], gpu[:N], npu[:N], auto")
    precisions = ["fp32", "fp16", "bf16", "default"]
    if engines:  # bench takes calibration inputs (--calibration)
        precisions[3:3] = ["int8", "auto"]
    p.add_argument("--precision", default=None, choices=precisions)
    p.add_argument("--policy", type=Path, default=None, help="ExecutionPolicy file")
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME=DxDxD",
        help="shape of a generated input (for dynamic dims); repeatable",
    )
    p.add_argument("--seed", type=_seed, default=0, help="seed of generated inputs (>= 0)")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (math.isfinite(value) and 0 < value <= MAX_BENCH_SECONDS):
        raise argparse.ArgumentTypeError(
            f"expected seconds > 0 and <= {MAX_BENCH_SECONDS:g}, got {text!r}"
        )
    return value


def _concurrency(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if not 1 <= value <= MAX_CONCURRENCY:
        raise argparse.ArgumentTypeError(
            f"expected an integer from 1 to {MAX_CONCURRENCY}, got {text!r}"
        )
    return value


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return value


def _policy_from(args: argparse.Namespace, **changes: Any):
    from .policies import ExecutionPolicy

    policy = ExecutionPolicy.load(args.policy) if args.policy else ExecutionPolicy()
    for field in ("device", "precision", "performance"):
        if getattr(args, field, None) is not None:
            changes[field] = getattr(args, field)
    if getattr(args, "engine", None) is not None:
        changes["engine"] = args.engine
    return policy.replace(**changes) if changes else policy


def _shapes(args: argparse.Namespace, model) -> dict[str, tuple[int, ...]]:
    """``--shape NAME=DxDxD`` for inputs the model has, with sane dimensions."""
    names = [s.name for s in model.inputs]
    shapes = {}
    for item in args.shape:
        name, _, dims = item.partition("=")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            raise InvalidInputError(f"--shape: expected NAME=DxDxD, got {item!r}") from None
        if name not in names:
            raise InvalidInputError(
                f"--shape {item!r}: the model has no input {name!r}; its inputs are {names}"
            )
        if any(d < 0 for d in shape):
            raise InvalidInputError(f"--shape {item!r}: dimensions must be >= 0")
        if math.prod(shape) > MAX_GENERATED_ELEMENTS:
            raise InvalidInputError(
                f"--shape {item!r}: {math.prod(shape)} elements; generated inputs have at "
                f"most {MAX_GENERATED_ELEMENTS}"
            )
        shapes[name] = shape
    return shapes


def _feeds(args: argparse.Namespace, model) -> dict[str, Any]:
    from .inference import generate_inputs

    shapes = _shapes(args, model)
    feeds: dict[str, Any] = {}
    for item in getattr(args, "input", []):
        name, sep, file = item.rpartition("=") if "=" in item else ("", "", item)
        loaded = _arrays(file, f"--input {item!r}")
        if isinstance(loaded, dict):
            feeds.update(loaded)
            continue
        if not sep:
            raise InvalidInputError(f"--input {item!r}: a .npy file needs NAME=FILE.npy")
        feeds[name] = loaded
    missing = [s for s in model.inputs if s.name not in feeds]
    if missing:
        feeds.update(
            generate_inputs(
                missing,
                seed=args.seed,
                shapes={k: v for k, v in shapes.items() if k in {s.name for s in missing}},
            )
        )
    return feeds


def _arrays(file: Any, what: str) -> Any:
    """An .npy file's array or an .npz file's arrays by name (read whole, here, where a
    pickle is refused), or an InvalidInputError naming ``what`` and the file."""
    import zipfile

    import numpy as np

    try:
        loaded = np.load(file, allow_pickle=False)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded:  # members are read (and checked for pickles) here
                return {k: loaded[k] for k in loaded.files}
        return loaded
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise InvalidInputError(
            f"{what}: cannot read {file} as .npy/.npz without pickles: {e}"
        ) from e


def _engine_names(args: argparse.Namespace, device: str) -> list[str]:
    from .engines import engines

    if args.engines:
        return [e.strip() for e in args.engines.split(",") if e.strip()]
    return engines.order(device.split(":")[0])


# -- commands ------------------------------------------------------------------------------
def _devices(args: argparse.Namespace, console) -> int:
    from rich.table import Table

    from .runtime import DeviceManager

    manager = DeviceManager.instance()
    table = Table(title="devices")
    for column in (
        "device",
        "name",
        "backend",
        "memory (GiB)",
        "capability",
        "SMs",
        "fp16",
        "bf16",
        "int8",
    ):
        table.add_column(column)
    for info in manager.devices:
        memory = "" if info.total_memory is None else f"{info.total_memory / 2**30:.1f}"
        cc = "" if info.compute_capability is None else "{}.{}".format(*info.compute_capability)
        table.add_row(
            str(info.device),
            info.name,
            info.backend,
            memory,
            cc,
            "" if info.sm_count is None else str(info.sm_count),
            *(
                "yes" if f else "no"
                for f in (info.supports_fp16, info.supports_bf16, info.supports_int8)
            ),
        )
    console.print(table)
    probes = Table(title="backends")
    for column in ("probe", "found", "detail"):
        probes.add_column(column)
    for report in manager.probes:
        probes.add_row(report.backend, "yes" if report.ok else "no", escape(report.detail))
    console.print(probes)
    _ep_devices(console)
    return 0


def _ep_devices(console) -> None:
    """ONNX Runtime's (EP, device) pairs, plugin EPs included."""
    import importlib.util

    from rich.table import Table

    if importlib.util.find_spec("onnxruntime") is None:
        return
    from .runtime._ort_plugins import PLUGIN_EPS, ep_devices, plugin_problem

    table = Table(title="ONNX Runtime execution-provider devices")
    for column in ("EP", "vendor", "device", "device vendor"):
        table.add_column(column)
    table.add_column("note", overflow="fold")
    try:
        found = ep_devices()
    except Exception as e:  # an onnxruntime without the device API
        console.print(f"ONNX Runtime EP devices: not listed ({escape(str(e))})")
        return
    for d in found:
        note = "HTP emulation on the host CPU, not an NPU" if d.emulated else ""
        table.add_row(d.ep, d.ep_vendor, d.device_type, d.device_vendor, note)
    for ep in PLUGIN_EPS:
        problem = plugin_problem(ep)
        if problem is not None:
            table.add_row(ep, "", "", "", escape(f"plugin not available: {problem}"))
    console.print(table)


def _run(args: argparse.Namespace, console) -> int:
    import numpy as np

    from .inference import InferenceSession

    with InferenceSession(args.model, policy=_policy_from(args)) as session:
        feeds = _feeds(args, session)
        outputs = session.run(feeds)
        if args.explain:
            console.print(session.explain(), highlight=False, soft_wrap=True)
        from rich.table import Table

        table = Table(title=f"{args.model.name} on {session.engine} ({session.device})")
        for column in ("output", "shape", "dtype", "min", "max", "mean"):
            table.add_column(column)
        for spec, out in zip(session.outputs, outputs):
            numeric = out.size and out.dtype.kind in "biuf"
            stats = (
                [f"{np.min(out):.4g}", f"{np.max(out):.4g}", f"{np.mean(out):.4g}"]
                if numeric
                else ["", "", ""]
            )
            table.add_row(spec.name, str(tuple(out.shape)), str(out.dtype), *stats)
        console.print(table)
    return 0


def _bench(args: argparse.Namespace, console) -> int:
    from rich.progress import Progress
    from rich.table import Table

    from .inference import InferenceSession

    base = _policy_from(args, strict=True)
    calibration = _calibration(args.calibration)
    if base.precision == "int8" and calibration is None:
        raise InvalidInputError("--precision int8 needs --calibration DIR_OR_NPZ")
    rows = []
    with Progress(console=console, transient=True) as progress:
        for name in _engine_names(args, base.device):
            task = progress.add_task(f"{name}", total=None)
            try:
                with InferenceSession(
                    args.model, policy=base.replace(engine=name), calibration_inputs=calibration
                ) as session:
                    feeds = _feeds(args, session)
                    tick = lambda n, t=task: progress.update(t, completed=n)  # noqa: E731
                    result = (
                        _timed_runs(session, feeds, args.seconds, tick)
                        if args.concurrency == 1
                        else _timed_in_flight(session, feeds, args, tick)
                    )
                    settings = session.engine_settings
                    result.update(
                        engine=name,
                        precision=settings.get("precision", base.precision),
                        performance=settings.get("performance"),
                    )
                rows.append(result)
            except XpuRuntimeError as e:
                rows.append({"engine": name, "error": f"{type(e).__name__}: {e}"})
            progress.remove_task(task)
    what = "latency" if args.concurrency == 1 else f"{args.concurrency} requests in flight"
    table = Table(title=f"{args.model.name}: {what} on {base.device} ({base.precision})")
    for column in ("engine", "p50 ms", "p90 ms", "p99 ms", "results/s", "runs"):
        table.add_column(column)
    table.add_column("note", overflow="fold")
    for row in rows:
        if "error" in row:
            table.add_row(row["engine"], "", "", "", "", "", escape(row["error"]))
            continue
        notes = [str(row["precision"])] if base.precision in ("int8", "auto") else []
        if row["runs"] >= MAX_BENCH_RUNS:
            notes.append(f"stopped at the cap of {MAX_BENCH_RUNS} runs")
        table.add_row(
            row["engine"],
            *(f"{row[k]:.3f}" for k in ("p50_ms", "p90_ms", "p99_ms")),
            f"{row['results_per_s']:.1f}",
            str(row["runs"]),
            escape("; ".join(notes)),
        )
    console.print(table)
    if args.json is not None:
        from ._files import atomic_write_bytes
        from .runtime._discovery import usable_cores

        report = {
            "model": str(args.model),
            "policy": base.to_dict(),
            "concurrency": args.concurrency,
            "cores": usable_cores(),
            "calibration_batches": None if calibration is None else len(calibration),
            "rows": rows,
        }
        try:
            atomic_write_bytes(args.json, (json.dumps(report, indent=2) + "\n").encode())
        except OSError as e:
            raise InvalidInputError(f"--json {args.json}: cannot write the report: {e}") from e
    return 0 if any("error" not in row for row in rows) else 2


def _timed_runs(session, feeds, seconds: float, tick) -> dict[str, Any]:
    """One ``run`` after another: per-call latency, and its inverse as results/s."""
    from .inference import measure_latency

    stats = measure_latency(
        lambda: session.run(feeds),
        min_seconds=seconds,
        max_iterations=MAX_BENCH_RUNS,
        on_iteration=tick,
    )
    return _row(list(stats.samples), len(stats.samples) / sum(stats.samples))


def _timed_in_flight(session, feeds, args: argparse.Namespace, tick) -> dict[str, Any]:
    """``--concurrency`` requests kept in flight through ``run_async`` for ``--seconds``:
    completed results per second of wall time, and each request's latency from
    submission to result."""
    import threading
    import time

    for _ in range(2):
        session.run(feeds)  # warm-up
    latencies: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    slots = threading.Semaphore(args.concurrency)

    def done(begun: float, future) -> None:
        finished = time.perf_counter()
        with lock:
            if future.exception() is not None:
                errors.append(future.exception())
            else:
                latencies.append(finished - begun)
        slots.release()

    started = time.perf_counter()
    submitted = 0
    while time.perf_counter() - started < args.seconds and submitted < MAX_BENCH_RUNS:
        slots.acquire()
        submitted += 1
        begun = time.perf_counter()
        session.run_async(feeds).add_done_callback(lambda f, begun=begun: done(begun, f))
        tick(submitted)
    for _ in range(args.concurrency):  # every request in flight has finished
        slots.acquire()
    if errors:
        raise errors[0]  # a failed request fails the benchmark
    elapsed = time.perf_counter() - started
    return _row(latencies, len(latencies) / elapsed)


def _row(latencies: list[float], per_second: float) -> dict[str, Any]:
    import numpy as np

    ms = np.asarray(latencies) * 1e3
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p90_ms": float(np.percentile(ms, 90)),
        "p99_ms": float(np.percentile(ms, 99)),
        "results_per_s": float(per_second),
        "runs": len(latencies),
    }


def _calibration(path: Path | None) -> list[dict[str, Any]] | None:
    """``--calibration``: batches from an .npz (leading axis over batches) or a folder
    of .npz files (one batch each, in name order)."""
    if path is None:
        return None
    files = sorted(path.glob("*.npz")) if path.is_dir() else [path]
    if not files:
        raise InvalidInputError(f"--calibration {path}: the folder holds no .npz files")
    batches = []
    for file in files:
        arrays = _arrays(file, f"--calibration {file}")
        if not isinstance(arrays, dict):
            raise InvalidInputError(f"--calibration {file}: expected an .npz, got one .npy array")
        if not arrays:
            raise InvalidInputError(f"--calibration {file}: no arrays in it")
        if path.is_dir():
            batches.append(arrays)
            continue
        counts = {name: value.shape[0] if value.ndim else 0 for name, value in arrays.items()}
        if len(set(counts.values())) != 1 or 0 in counts.values():
            raise InvalidInputError(
                f"--calibration {file}: expected every array to stack the batches on a "
                f"leading axis of one length, got leading sizes {counts}"
            )
        count = next(iter(counts.values()))
        batches += [{name: value[i] for name, value in arrays.items()} for i in range(count)]
    return batches


def _compare(args: argparse.Namespace, console) -> int:
    from .inference import Model, compare

    policy = _policy_from(args)
    model = Model.load(args.model)
    report = compare(
        model,
        engines=_engine_names(args, policy.device),
        inputs=_feeds(args, model),
        device=policy.device,
        precision=policy.precision,
        rtol=args.rtol,
        atol=args.atol,
    )
    console.print(_report_table(report, f"{args.model.name}: accuracy"))
    return 0 if report.passed else 1


def _report_table(report, title: str):
    from rich.table import Table

    table = Table(
        title=f"{title} vs {report.reference} "
        f"(pass: |out-ref| <= {report.atol:g} + {report.rtol:g}*|ref|)"
    )
    for column in ("engine", "output", "max abs", "max rel", "rel L2", "result"):
        table.add_column(column)
    for r in report.rows:
        verdict = "[green]pass[/]" if r.passed else f"[red]FAIL[/] {escape(r.error or '')}"
        table.add_row(
            r.engine, r.output, f"{r.max_abs:.3g}", f"{r.max_rel:.3g}", f"{r.rel_l2:.3g}", verdict
        )
    return table


def _policy(args: argparse.Namespace, console) -> int:
    from .policies import ExecutionPolicy, KernelPolicy, read_document

    data = read_document(args.file)
    if _is_execution_policy(data, str(args.file)):
        policy = ExecutionPolicy.from_dict(data, source=str(args.file))
    else:
        policy = KernelPolicy.from_dict(data, source=str(args.file))
    if args.action == "validate":
        console.print(
            f"{args.file}: valid {type(policy).__name__} (fingerprint {policy.fingerprint()})",
            highlight=False,
            soft_wrap=True,
        )
    else:
        console.print_json(json.dumps(policy.to_dict()))
        console.print(f"fingerprint {policy.fingerprint()}", highlight=False, soft_wrap=True)
    return 0


def _is_execution_policy(data: dict[str, Any], source: str) -> bool:
    """Whether a policy document is an execution (inference) policy, not a kernel
    (training) one: by its schema, else by the kind whose fields it names more of (a
    document naming as many unknown to either is refused, with both lists)."""
    import dataclasses

    from ._errors import PolicyError
    from .policies import ExecutionPolicy
    from .policies._document import unknown_fields
    from .policies._kernel_policy import FIELDS

    schema = str(data.get("schema", ""))
    if schema:
        return schema.startswith("xpuruntime.execution_policy")
    execution = ["schema", *(f.name for f in dataclasses.fields(ExecutionPolicy))]
    not_execution, not_kernel = set(data) - set(execution), set(data) - set(FIELDS)
    if not (not_execution or not_kernel):
        return "kernels" not in data
    if len(not_execution) == len(not_kernel):
        raise PolicyError(
            f"{source}: neither policy: as a kernel policy, "
            f"{unknown_fields(not_kernel, FIELDS)}; as an execution policy, "
            f"{unknown_fields(not_execution, execution)}"
        )
    return len(not_execution) < len(not_kernel)


def _demo(args: argparse.Namespace, console) -> int:
    from rich.table import Table

    from .engines import engines
    from .inference import InferenceSession, Model, compare, generate_inputs, measure_latency
    from .policies import ExecutionPolicy
    from .runtime import DeviceManager

    model = demo_model_path()
    console.print(
        f"[bold]xpuruntime demo[/]: {model.name} (a small CNN shipped in the "
        "package) on every engine available here\n"
    )
    _devices(args, console)
    devices = [
        "cpu",
        *[str(i.device) for i in DeviceManager.instance().devices if i.kind == "cuda"][:1],
    ]
    table = Table(title="engines on the demo model (batch 8)")
    for column in ("device", "engine", "decision", "accuracy vs ORT CPU fp32", "p50 ms"):
        table.add_column(column)
    table.add_column("note", overflow="fold")
    model_spec = Model.load(model)
    feeds = generate_inputs(model_spec.inputs, shapes={"image": (8, 3, 32, 32)})
    for device in devices:
        base = ExecutionPolicy(device=device, strict=True)
        names = engines.order(device.split(":")[0])
        # One comparison for all engines: the ORT CPU reference is computed once.
        report = compare(model_spec, engines=names, inputs=feeds, device=device)
        for name in names:
            try:
                with InferenceSession(model_spec, policy=base.replace(engine=name)) as session:
                    stats = measure_latency(
                        lambda s=session: s.run(feeds), min_seconds=args.seconds
                    )
                    rows = [r for r in report.rows if r.engine == name]
                    worst = max(rows, key=lambda r: r.rel_l2)
                    verdict = "pass" if report.engine_passed(name) else "FAIL"
                    accuracy = f"{verdict} (rel L2 {worst.rel_l2:.1e})"
                    table.add_row(
                        device,
                        name,
                        session.decision.source,
                        accuracy,
                        f"{stats.p50 * 1e3:.3f}",
                        escape(_settings_note(session)),
                    )
            except XpuRuntimeError as e:
                table.add_row(
                    device,
                    name,
                    "[yellow]unavailable[/]",
                    "",
                    "",
                    escape(f"{type(e).__name__}: {e}"),
                )
        with InferenceSession(model_spec, device=device) as session:
            table.add_row(
                device,
                f"auto -> {session.engine}",
                session.decision.source,
                "",
                "",
                escape(session.decision.reason.split(";")[0]),
            )
    console.print(table)
    return 0


def _settings_note(session) -> str:
    settings = session.engine_settings
    keys = ("providers", "device", "inference_precision")
    return ", ".join(f"{k}={settings[k]}" for k in keys if k in settings)


if __name__ == "__main__":
    sys.exit(main())
