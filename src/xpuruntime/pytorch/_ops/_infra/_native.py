"""Launch plans: an op's Triton kernels launched from C++, behind one autograd node, as
PyTorch's own ops are.

From Python, each launch of ours costs ~12 µs of host time and an autograd.Function
node about as much as PyTorch's whole layer norm forward and backward (H200 host); at
small shapes that host time is the op's cost. So, per call signature of an op that comes
back (its first call runs the Python path: a shape seen once never pays for a plan), the
second call derives a plan from the op's own Python launchers, run dry: with the call's
tensors (aliased, never copied), each launch is compiled with Triton's warm-up API and
not launched, so nothing runs on the device, nothing is written and nothing waits for it.
What the launchers hand each launch becomes the plan: the compiled kernel and its grid,
each integer as given, the call's float scalar (a norm's eps) as a runtime slot, and each
tensor as a slot naming where it came from, by the storage it lives in: an input, a
buffer the launchers allocated (sized from the call's shapes), a view of either, and in
the backward, what the forward left (its inputs and buffers). :file:`_native.cpp` runs
that plan on the deriving call and every later call of the signature: it allocates the
buffers, launches the same compiled kernels with the call's tensors and scalar, and
records one autograd node whose backward runs the backward plan. The plan's
key (the op's call signature: shapes, dtypes, device, which inputs are present) holds
everything the launchers read; a call the plan does not fit (another layout than the one
it was derived from: contiguous, or a per-head view's strides where the op allows one; a
misaligned input, another device, a CUDA-graph capture, a forward-mode tangent, an input
other than a plain CUDA tensor) returns None and takes the Python path, which takes any
call. Parameter gradients' partial rows are summed by our kernel in a plan (as
in a CUDA graph) and by ``Tensor.sum`` on the eager Python path, so they may differ in
the last bit.

A derivation refuses (and the op keeps its Python path) where a plan could not hold what
the launchers do: any PyTorch op other than allocations and views between the launches
(a cast, a fill, a reduction: the derivation stops at it, before it runs), a kernel
needing Triton's scratch memory, clusters or launch attributes, a launch hook set (a
profiler that must see launches), or a Triton whose launcher passes parameters otherwise
than the versions read (3.6 to 3.9). Plans hold their compiled kernels (Triton unloads a
kernel's module when its ``CompiledKernel`` is collected) and tables of them are bounded.

The C++ side is compiled with ``torch.utils.cpp_extension`` on first use (about 30 s
once on the H200 host, announced by a warning before it starts; later processes load
the built library directly, which works from a read-only directory too), or ahead of
time with ``python -m xpuruntime.pytorch.build``. It needs a C++ compiler, ninja and the
CUDA headers (``CUDA_HOME``, or NVIDIA's pip packages); without them, or with
``XPURUNTIME_NATIVE_LAUNCH=0`` (read before anything is built), every call takes the
Python path and the log says why once. Builders hold an advisory lock that dies with
them: a builder killed mid-build (an OOM or a batch scheduler's kill) leaves nothing
that blocks the next one, and a wait for a live builder ends after ``BUILD_WAIT``
seconds with the reason.

The same machinery builds the LoRA op's C++ node (:func:`lora_node`,
:file:`_lora_node.cpp`) from ATen's headers alone: no CUDA headers, so it builds on a
CPU-only machine too, where the tests run it against the op's Python path.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

from ....kernels import dispatcher
from . import _cached_launch
from ._capture_paths import capture_paths
from ._launch import interpreting

__all__ = [
    "BUILD_WAIT",
    "PlanTable",
    "Replay",
    "build",
    "lora_node",
    "lora_node_unavailable",
    "replayed_call",
    "switched_off",
    "unavailable",
]

BUILD_WAIT = 600.0
"""Seconds a process waits for another one's build of the C++ side before giving up
(the build takes about 30 s; the Python path then runs, and the log says why)."""

_log = logging.getLogger("xpuruntime.pytorch.ops")
_dispatch_log = dispatcher.log  # while on, calls go through our registered torch ops
_lock = threading.RLock()
_module: Any = None
_why_not: str | None = None
_SOURCE = Path(__file__).with_name("_native.cpp")
_LORA_SOURCE = Path(__file__).with_name("_lora_node.cpp")
_HEADER = Path(__file__).with_name("_autograd_nodes.h")
_lora_module: Any = None
_lora_why_not: str | None = None
_Tensor = torch.Tensor
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_compiling = torch.compiler.is_compiling

# Slot kinds, as _native.cpp numbers them.
_PTR, _I32, _I64, _U32, _U64, _SCALAR, _NULL = range(7)
_INTS = {"i32": _I32, "i64": _I64, "u32": _U32, "u64": _U64}
# The float a derivation passes for the call's scalar: a float parameter holding it is
# the plan's runtime slot; one holding anything else (a constant, a value computed from
# the scalar) is a float no plan could give each call, and the derivation refuses.
_SCALAR_PROBE = 0.0911239318
# Between launches a plan may allocate and take views, nothing else.
_ALLOWED = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "view",
    "_unsafe_view", "reshape", "select", "slice", "as_strided", "alias", "detach", "transpose",
    "promote_types", "result_type",
}  # fmt: skip


def unavailable() -> str | None:
    """Why launch programs cannot be replayed in this process (None: they can; the C++
    side is built on the first call that needs it)."""
    off = switched_off()
    if off is not None:
        return off
    if interpreting() or not torch.cuda.is_available():
        return "no CUDA device (Triton's interpreter launches nothing)"
    return _unread_triton() or _why_not


@functools.cache
def _unread_triton() -> str | None:
    """Why this Triton's launcher cannot take our plans (read once: it runs on every
    call a plan might take before one is derived)."""
    import triton

    version = tuple(int(p) for p in triton.__version__.split(".")[:2])
    if not (3, 6) <= version < (3, 10):
        return (
            f"Triton {triton.__version__}'s launcher was not read (plans follow the "
            "parameter layout of Triton 3.6 to 3.9)"
        )
    return None


def switched_off() -> str | None:
    """``"XPURUNTIME_NATIVE_LAUNCH=0"`` when the user switched native launches off (then
    nothing is built or loaded), else None."""
    if os.environ.get("XPURUNTIME_NATIVE_LAUNCH", "1") == "0":
        return "XPURUNTIME_NATIVE_LAUNCH=0"
    return None


def _extension() -> Any:
    """The compiled C++ side (loaded or built once per process), or None with the
    reason in ``unavailable()``. Callers check ``unavailable()`` first: nothing is built
    while the switch is off."""
    global _module, _why_not
    with _lock:
        if _module is not None or _why_not is not None:
            return _module
        try:
            _module = build()
        except Exception as e:  # no compiler, headers or ninja: Python launches, said once
            _why_not = f"the C++ launcher could not be built ({type(e).__name__}: {e})"
            _log.warning("native launches off: %s; our kernels launch from Python", _why_not)
            return None
        return _module


def build(wait: float = BUILD_WAIT) -> Any:
    """Load the C++ side, building it first if no process has (the module).

    Raises
    ------
    TimeoutError
        Another process held the build lock for more than ``wait`` seconds.
    OSError, RuntimeError
        Native launches are switched off; no CUDA headers, compiler or ninja; the build
        failed.
    """
    return _built("native launcher", (_SOURCE, _HEADER), "make_plan", True, wait)


def lora_node() -> Any:
    """The C++ side of the ``lora_linear`` op's common call (:file:`_lora_node.cpp`:
    its GEMMs and its backward node, without Python), loaded or built once per process
    (ATen's headers alone: no CUDA needed); None where native code is switched off, or
    where it cannot be built (said once)."""
    global _lora_module, _lora_why_not
    if _lora_module is not None or _lora_why_not is not None or switched_off() is not None:
        return _lora_module
    with _lock:
        if _lora_module is None and _lora_why_not is None:
            try:
                _lora_module = _built(
                    "LoRA node", (_LORA_SOURCE, _HEADER), "lora_forward", False, BUILD_WAIT
                )
            except Exception as e:  # no compiler or ninja: said once
                _lora_why_not = f"{type(e).__name__}: {e}"
                _log.warning(
                    "the lora_linear op's C++ node could not be built (%s); its calls run "
                    "from Python", _lora_why_not,
                )  # fmt: skip
        return _lora_module


def lora_node_unavailable() -> str | None:
    """Why :func:`lora_node` gave None (None: it has not, or not yet, failed)."""
    return _lora_why_not


def _built(what: str, sources: tuple[Path, ...], marker: str, cuda: bool, wait: float) -> Any:
    """The extension ``what`` of ``sources`` (the ``.cpp`` files compiled, every file in
    its tag), loaded, or built first under the build lock; ``marker``: a name it defines;
    ``cuda``: it includes CUDA's headers."""
    from torch.utils import cpp_extension

    off = switched_off()
    if off is not None:
        raise RuntimeError(f"{off} switches native launches off")

    text = b"".join(path.read_bytes() for path in sources)
    tag = hashlib.sha256(text + torch.__version__.encode()).hexdigest()[:12]
    name = f"xpuruntime_{what.split()[0].lower()}_{tag}"
    directory = Path(cpp_extension._get_build_directory(name, verbose=False))
    library = directory / f"{name}.so"
    if not os.access(directory, os.W_OK):  # a read-only deployment: what was built ahead
        module = _import_built(name, library, marker)
        if module is None:
            raise FileNotFoundError(
                f"{library} is missing or cannot be loaded, and {directory} is read-only "
                "(build it ahead of time: python -m xpuruntime.pytorch.build)"
            )
        return module
    # Under the lock, so that no library a live builder is still writing is loaded.
    with _build_lock(directory, wait):
        module = _import_built(name, library, marker)
        if module is not None:
            return module
        library.unlink(missing_ok=True)  # a partial file, from a builder that died
        includes = _cuda_includes() if cuda else []
        if cuda and not includes:
            raise FileNotFoundError(
                "no CUDA headers (set CUDA_HOME, or pip install the CUDA runtime)"
            )
        _log.warning(
            "building xpuruntime's %s in %s (C++, about 30-60 s, once per torch version; "
            "it runs our ops' host work without Python's cost). XPURUNTIME_NATIVE_LAUNCH=0 "
            "switches it off; python -m xpuruntime.pytorch.build builds it ahead of time",
            what, directory,
        )  # fmt: skip
        start = time.perf_counter()
        module = cpp_extension.load(
            name=name,
            sources=[str(path) for path in sources if path.suffix == ".cpp"],
            extra_cflags=["-O2"],
            extra_include_paths=includes,
            extra_ldflags=["-ldl"] if cuda else [],
            build_directory=str(directory),
            verbose=False,
        )
    _log.warning("%s built in %.1f s", what, time.perf_counter() - start)
    return module


def _import_built(name: str, library: Path, marker: str) -> Any:
    """The extension module from an existing build, or None (absent, or unreadable:
    a partial file from a builder that died, which the next build replaces). Unlike
    ``cpp_extension.load``, writes nothing: a prebuilt directory may be read-only."""
    import importlib.util

    if not library.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception as e:
        _log.warning("the built library %s could not be loaded: %s", library, e)
        return None
    if not hasattr(module, marker):
        return None
    return module


@contextlib.contextmanager
def _build_lock(directory: Path, wait: float):
    """Hold this extension's build lock: an advisory ``flock``, released by the kernel
    when its holder dies, unlike PyTorch's ``FileBaton`` (a file whose owner, killed
    mid-build, leaves every later process waiting forever, silently)."""
    import fcntl

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "xpuruntime-build.lock"
    with open(path, "a") as handle:
        deadline = time.monotonic() + wait
        announced = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"another process has held {path} for over {wait:.0f} s while "
                        "building the native launcher"
                    ) from None
                if not announced:
                    _log.warning("waiting for another process's build of the native launcher")
                    announced = True
                time.sleep(0.2)
        try:
            # Every builder of this extension holds this lock: a baton of PyTorch's
            # found now was left by a builder that died.
            baton = directory / "lock"
            if baton.exists():
                _log.warning("removing %s, left by a build that did not finish", baton)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _cuda_includes() -> list[str]:
    """Directories holding cuda_runtime_api.h and what it includes."""
    from torch.utils import cpp_extension

    found = []
    home = cpp_extension.CUDA_HOME
    if home and os.path.exists(os.path.join(home, "include", "cuda_runtime_api.h")):
        found.append(os.path.join(home, "include"))
    try:
        import nvidia

        for root in nvidia.__path__:
            for header in ("cuda_runtime_api.h", "crt/host_config.h"):
                pattern = os.path.join(root, "**", "include", header)
                found += [p[: -len(header) - 1] for p in glob.glob(pattern, recursive=True)]
    except ImportError:
        pass
    return list(dict.fromkeys(found))


class Replay:
    """The launch plan of one call signature of an op.

    ``replay.call(x, a, b, c, scalar, out_dtype)`` runs the plan on a call's tensors (up
    to four, None where absent), its float argument and output dtype (never None), and
    returns the op's results, or None where the plan does not take the call (or none
    could be derived): the caller then runs its Python path. The first call returns None
    (a signature seen once keeps to the Python path, which costs less than deriving); the
    next call that a plan could take derives it (:func:`derive`) and runs it. Under saved
    tensor hooks (activation checkpointing), the first call derives: a checkpointed
    forward and its recompute then take the same path and save the same tensors.

    Parameters
    ----------
    name : str
        The op's name (the autograd node's).
    reference : callable
        ``reference(tensors, scalar, out_dtype)``: the op's Python path with autograd
        (its autograd.Function), returning its results (a tensor or a tuple).
    differentiable : bool
        Whether the op has a backward (derived through autograd); without one, a call
        autograd would have to record takes the Python path.
    strided : bool
        Whether a plan may be derived from a call whose first input is a strided view
        (a per-head view of wider rows that the launchers read in place): the plan then
        takes calls of those strides only. Where the launchers cannot take the view (they
        copy it), the derivation refuses and a later contiguous call derives instead.
    grads_as_results : bool
        Whether the backward is derived with each result's gradient laid out as the
        result (a per-head view of token-major memory, as attention hands its gradient
        back), not contiguous: a gradient laid out otherwise is copied to that layout.
    """

    def __init__(
        self,
        name: str,
        reference: Callable[..., Any],
        differentiable: bool = True,
        strided: bool = False,
        grads_as_results: bool = False,
    ) -> None:
        self.name = name
        self._reference = reference
        self._differentiable = differentiable
        self._strided = strided
        self._grads_as_results = grads_as_results
        self._kernels: list[Any] = []  # the plan launches their functions by handle
        self.call: Callable[..., Any] = self._first

    def _first(self, *args: Any) -> Any:
        self.call = self._derive  # the signature's next call
        if _saved_through_hooks():
            # Activation checkpointing re-runs a forward and requires it to save what the
            # first run saved: a first call that took the Python path and a recompute that
            # derived the plan save different tensors. Under hooks, derive now, so that
            # every call of the signature takes the same path.
            return self._derive(*args)
        return None

    def _derive(self, *args: Any) -> Any:
        tensors, (scalar, out_dtype) = args[:4], args[4:]
        why = unavailable()  # read before anything is built: the switch stops the build
        if why is None and not _derivable_now(tensors, self._strided):
            return None  # a later call, which a plan could take, derives it
        self.call = _refuse
        if why is None:
            extension = _extension()
            why = unavailable()  # says why the extension could not be built
        if why is None:
            try:
                arguments, kernels = derive(
                    self.name, self._reference, self._differentiable, tensors, out_dtype,
                    self._grads_as_results,
                )  # fmt: skip
                self.call, self._kernels = extension.make_plan(*arguments), kernels
            except _NotReplayable as e:
                why = str(e)
            except Exception as e:  # a bug of ours: said, and the Python path runs
                why = f"deriving the plan failed ({type(e).__name__}: {e})"
                _log.warning("%s: %s; launched from Python", self.name, why)
            if why is not None and not tensors[0].is_contiguous():
                self._strided = False  # the launchers copy this view: contiguous calls only
                self.call = self._derive
        if why is not None:
            shape = tuple(tensors[0].shape)
            _log.debug("%s on %s: launched from Python (%s)", self.name, shape, why)
        return self.call(*tensors, scalar, out_dtype)


def _refuse(*args: Any) -> None:
    return None


def _unhooked_saves() -> contextlib.AbstractContextManager:
    """Saves that reach no outer saved-tensor hooks (identity hooks stacked on them)."""
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def _same(t: Any) -> Any:
    return t


def _saved_through_hooks() -> bool:
    """Whether autograd saves tensors through default hooks here (activation
    checkpointing, CPU offloading), which may compare or replay what each op saved."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _derivable_now(tensors: tuple, strided: bool = False) -> bool:
    """Whether a plan derived from this call would take it: a plan runs outside graph
    captures, inference mode and others' dispatch modes, on the current device, on
    contiguous 16-byte aligned inputs that do not overlap (a plan derived from overlapping
    inputs would read one for the other on a later call); with ``strided``, the first
    input may be a strided view."""
    given = [t for t in tensors if t is not None]
    if (
        torch.is_inference_mode_enabled()
        or capture_paths(given[0].device)
        or _current_dispatch_mode() is not None
    ):
        return False
    if given[0].device.index != torch.cuda.current_device():
        return False
    extents = []
    for t in given:
        if t.data_ptr() & 15 or not (t.is_contiguous() or (strided and t is given[0])):
            return False
        storage, start = _where(t)
        end = start + _span(t)
        if any(s == storage and a < end and start < b for s, a, b in extents):
            return False
        extents.append((storage, start, end))
    return True


def replayed_call(
    table: PlanTable,
    input: Any,
    residual: Any,
    normalized_shape: Any,
    eps: Any,
    out_dtype: Any,
    *params: Any,
    checked: bool = False,
) -> Any:
    """A public norm op's call run by its plan, or None: the caller then runs its Python
    path (checking the arguments first, unless ``checked``). ``residual``: the tensor
    added to ``input`` before the norm (the add-and-norm ops), None for a norm alone.

    The key holds what a plan is derived for and would otherwise refuse for good: the
    inputs' shape, dtypes and device, the normalized shape, and each parameter's dtype
    and whether it trains (a frozen one's gradient is not computed), or its absence. A
    call whose key has a plan goes straight to it (the plan itself refuses, with None,
    any call it was not derived for); a ``checked`` call makes the key's
    plan, derived on the key's next call that it can take. Only plain CUDA tensors, a
    real ``eps`` (None: the epsilon of the dtype normalised, as ``nn.RMSNorm``) and a
    dtype or None for ``out_dtype`` (None: the dtype normalised); never while the
    dispatch log records or torch.compile traces."""
    if input.__class__ is not _Tensor or not input.is_cuda or _dispatch_log.enabled or _compiling():
        return None  # (through_registered_op(), inline: this runs on every call)
    total = input.dtype
    if residual is not None:
        if residual.__class__ is not _Tensor:
            return None
        if residual.dtype != total:
            total = torch.promote_types(total, residual.dtype)
    if eps is None:
        eps = torch.finfo(total).eps
    elif eps.__class__ not in (float, int):
        return None
    if out_dtype is None:
        out_dtype = total
    elif out_dtype.__class__ is not torch.dtype:
        return None
    if normalized_shape.__class__ is not tuple:
        if normalized_shape.__class__ is int:
            normalized_shape = (normalized_shape,)
        elif isinstance(normalized_shape, (list, torch.Size)):
            normalized_shape = tuple(normalized_shape)
        else:
            return None
    kinds = []
    for p in params:
        if p is None:
            kinds.append(None)
        elif p.__class__ in _TENSORS:
            kinds.append((p.dtype, p.requires_grad))
        else:
            return None
    key = (input.shape, normalized_shape, input.dtype, input.get_device(), *kinds)
    if residual is not None:
        key += (residual.dtype,)
    replay = table.get(key) if checked else table.find(key)
    if replay is None:
        return None
    a, b = (*params, None, None)[:2]
    if residual is None:
        return replay.call(input, a, b, None, eps, out_dtype)
    return replay.call(input, residual, a, b, eps, out_dtype)


class PlanTable:
    """Replays by call signature (a hashable key), the oldest dropped past ``size``: what
    a public op looks its plan up in, so that its arguments are checked on a miss only
    (a plan refuses, returning None, any call it was not derived for).

    Parameters
    ----------
    make : callable
        ``make(key) -> Replay`` for a key not in the table.
    size : int
        The most plans kept (each holds its programs and compiled kernels).
    """

    def __init__(self, make: Callable[[tuple], Replay], size: int = 256) -> None:
        self._make = make
        self._size = size
        self._table: dict[tuple, Replay] = {}

    def find(self, key: tuple) -> Replay | None:
        """The replay of ``key``'s calls, None where none was made."""
        return self._table.get(key)

    def get(self, key: tuple) -> Replay:
        """The replay of ``key``'s calls, made on first use."""
        replay = self._table.get(key)
        if replay is None:
            with _lock:
                replay = self._table.get(key)
                if replay is None:
                    if len(self._table) >= self._size:  # dicts keep insertion order
                        del self._table[next(iter(self._table))]
                    replay = self._table[key] = self._make(key)
        return replay


class _NotReplayable(Exception):
    """A derivation that a plan could not hold."""


class _OpsCheck(TorchDispatchMode):
    """Stops a derivation at any PyTorch op other than allocations and views, before it
    runs."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in _ALLOWED:
            raise _NotReplayable(f"{func} runs between the launches")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _planned(launches: list):
    """Run the block with this thread's launches compiled into ``launches``, not run."""
    with _OpsCheck(), torch.autograd.set_multithreading_enabled(False):
        _cached_launch.plan_launches(launches)
        try:
            yield
        finally:
            _cached_launch.plan_launches(None)


def derive(
    name: str,
    reference: Callable[..., Any],
    differentiable: bool,
    tensors: tuple,
    out_dtype: torch.dtype,
    grads_as_results: bool = False,
) -> tuple[tuple, list]:
    """The arguments of ``make_plan`` (:file:`_native.cpp`) for the call signature of
    ``tensors``, and the compiled kernels the plan launches: the op's forward and
    backward (``reference`` through autograd) run dry on aliases of ``tensors``, each
    launch compiled and not launched (the results' gradients contiguous, or laid out as
    the results where ``grads_as_results``).

    Raises
    ------
    _NotReplayable
        What the launchers do that a plan could not hold.
    """
    from triton import knobs

    if getattr(knobs.runtime.launch_enter_hook, "calls", True):
        raise _NotReplayable("a Triton launch hook is set")
    # Activations as needing their gradient (a plan serves either); a frozen parameter as
    # frozen (its call signature's key says so), so that its gradient is not computed.
    inputs = [None if t is None else t.detach().requires_grad_(
        differentiable and (t.requires_grad or not isinstance(t, torch.nn.Parameter)))
        for t in tensors]  # fmt: skip
    given = [t for t in inputs if t is not None and t.requires_grad]
    fwd_launches: list = []
    bwd_launches: list = []
    expected: tuple = (None,) * len(given)
    # The dry run's saves are its own: a checkpoint's hooks (which count and drop what the
    # forward saves) must not see them.
    with _unhooked_saves():
        with torch.enable_grad(), _planned(fwd_launches):
            results = reference(inputs, _SCALAR_PROBE, out_dtype)  # a runtime slot of the plan
        results = results if isinstance(results, tuple) else (results,)
        layout = torch.preserve_format if grads_as_results else torch.contiguous_format
        grads = [torch.empty_like(r, memory_format=layout) for r in results]
        if differentiable:
            with _planned(bwd_launches):
                expected = torch.autograd.grad(results, given, grads, allow_unused=True)

    rows = tuple(inputs[0].shape)
    fwd = _Program(inputs, rows)
    fwd_spec = fwd.spec(fwd_launches, results, forward=True)
    bwd = _Program(grads if differentiable else [], rows, saved_from=fwd)
    bwd_spec = bwd.spec(bwd_launches, [g for g in expected if g is not None], forward=False)
    grad_of_input, grads_of_given, k = [], iter(expected), 0
    for t in inputs:
        g = None if t is None or not t.requires_grad else next(grads_of_given)
        grad_of_input.append(-1 if g is None else k)
        k += g is not None
    result_entries = {fwd.entry_of(r) for r in results}
    arguments = (
        name, inputs[0].device.index or 0, fwd_spec, bwd_spec, len(results), out_dtype,
        [None if t is None else t.dtype for t in inputs],
        [[] if t is None else list(t.shape) for t in inputs],
        [[] if t is None or t.is_contiguous() else list(t.stride()) for t in inputs],
        bwd.saved, [entry in result_entries for entry in bwd.saved], grad_of_input, differentiable,
        [[] if g.is_contiguous() else list(g.stride()) for g in grads],
    )  # fmt: skip
    return arguments, [kernel for kernel, _, _ in (*fwd_launches, *bwd_launches)]


class _Program:
    """One program's spec from planned launches. Its table, as _native.cpp lays it out:
    the given tensors (the call's inputs, or the results' gradients), then, in a
    backward, the forward's table entries it reads (``saved``), then the buffers the
    launches write, allocated afresh on each replay."""

    def __init__(self, given: list, rows: tuple, saved_from: _Program | None = None) -> None:
        self.rows = rows
        self.saved_from = saved_from
        self.given = len(given)
        self.saved: list[int] = []  # the forward's table entries
        self.buffers: list[tuple] = []  # (sizes, dtype, like_rows)
        self._tensors: dict[tuple[str, int], torch.Tensor] = {}  # each entry's tensor
        # storage -> [(first byte, bytes, table reference)]: where each entry lives
        self._storages: dict[int, list[tuple[int, int, tuple[str, int]]]] = {}
        for i, t in enumerate(given):
            if t is not None:
                self._add(("given", i), t)

    def _add(self, ref: tuple[str, int], t: torch.Tensor) -> None:
        storage, start = _where(t)
        self._storages.setdefault(storage, []).append((start, t.numel() * t.element_size(), ref))
        self._tensors[ref] = t

    def _find(self, storage: int, start: int) -> tuple[tuple[str, int], int] | None:
        """(table reference, byte offset) of the entry holding byte ``start`` of
        ``storage``, or None."""
        for first, size, ref in self._storages.get(storage, ()):
            if first <= start < first + max(size, 1):
                return ref, start - first
        return None

    def entry_of(self, t: torch.Tensor) -> int:
        """The table entry holding ``t``'s first element (KeyError: none)."""
        found = self._find(*_where(t))
        if found is None:
            raise KeyError(t)
        return self._number(found[0])

    def spec(self, launches: list, outputs: list, forward: bool) -> tuple:
        # Entries are found in launch order but numbered in table order at the end.
        refs = [self._launch(kernel, grid, values, forward) for kernel, grid, values in launches]
        outs = [self._output(t) for t in outputs]
        number = self._number
        launches_spec = [
            (fn, grid, threads, shared, [(k, number(e) if k == _PTR else 0, v) for k, e, v in slots],
             kernel_name)
            for fn, grid, threads, shared, slots, kernel_name in refs
        ]  # fmt: skip
        outs_spec = [
            (number(e), whole, offset, sizes, strides) for e, whole, offset, sizes, strides in outs
        ]
        return (self.given + len(self.saved), self.buffers, launches_spec, outs_spec)

    def _number(self, ref: tuple[str, int]) -> int:
        kind, i = ref
        if kind == "given":
            return i
        return self.given + (i if kind == "saved" else len(self.saved) + i)

    def _locate(self, t: torch.Tensor) -> tuple[tuple[str, int], int]:
        """(table reference, byte offset) of ``t``, adding a saved entry or a buffer."""
        storage, start = _where(t)
        found = self._find(storage, start)
        if found is not None:
            return found
        if self.saved_from is not None:
            source = self.saved_from._find(storage, start)
            if source is not None:
                self.saved.append(self.saved_from._number(source[0]))
                ref = ("saved", len(self.saved) - 1)
                self._add(ref, self.saved_from._tensors[source[0]])
                return ref, source[1]
        if start != 0 or t.numel() * t.element_size() != t.untyped_storage().nbytes():
            raise _NotReplayable("a launch took part of a buffer before the whole of it")
        like_rows = t.numel() == math.prod(self.rows)
        self.buffers.append((list(self.rows if like_rows else t.shape), t.dtype, like_rows))
        ref = ("buffer", len(self.buffers) - 1)
        self._add(ref, t)
        return ref, 0

    def _launch(self, kernel: Any, grid: tuple, values: tuple, forward: bool) -> tuple:
        if kernel is None:  # Triton compiling in the background: nothing to hold yet
            raise _NotReplayable("Triton gave no compiled kernel")
        md = kernel.metadata
        if getattr(md, "num_ctas", 1) != 1 or md.launch_cooperative_grid or md.launch_pdl:
            raise _NotReplayable(f"{kernel.name} needs launch attributes")
        if md.global_scratch_size or md.profile_scratch_size:
            raise _NotReplayable(f"{kernel.name} needs Triton's scratch memory")
        signature = kernel.src.signature
        slots = []
        for name, value in zip(kernel.src.fn.arg_names, values, strict=True):
            ty = signature[name]
            if ty == "constexpr":
                continue
            if isinstance(ty, str) and ty.startswith("*") and isinstance(value, torch.Tensor):
                ref, offset = self._locate(value)
                slots.append((_PTR, ref, offset))
            elif ty in _INTS and isinstance(value, int):
                slots.append((_INTS[ty], None, value))
            elif ty == "fp32" and forward and value == _SCALAR_PROBE:
                slots.append((_SCALAR, None, 0))  # the call's float (a norm's eps)
            else:
                raise _NotReplayable(
                    f"{kernel.name}: parameter {name} of type {ty} (a plan takes pointers, "
                    "ints and, in a forward, the call's own float)"
                )
        slots += [(_NULL, None, 0), (_NULL, None, 0)]  # Triton's global and profile scratch
        # Reading the launcher loads the compiled module on this device, if not yet.
        _ = kernel.run
        return (kernel.function, (*grid, 1, 1)[:3], 32 * md.num_warps, md.shared, slots,
                kernel.name)  # fmt: skip

    def _output(self, t: torch.Tensor) -> tuple:
        ref, offset = self._locate(t)
        whole = self._tensors[ref]
        allocated = self.buffers[ref[1]][0] if ref[0] == "buffer" else list(whole.shape)
        if (
            offset == 0
            and t.dtype == whole.dtype
            and list(t.shape) == list(allocated)
            and t.is_contiguous()
        ):
            return (ref, True, 0, [], [])
        if t.dtype != whole.dtype or offset % t.element_size():
            raise _NotReplayable("an output is not a view of a table entry")
        return (ref, False, offset // t.element_size(), list(t.shape), list(t.stride()))


def _span(t: torch.Tensor) -> int:
    """The bytes from ``t``'s first element to just past its last (strided too)."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _where(t: torch.Tensor) -> tuple[int, int]:
    """(storage, first byte) of ``t``: where it lives, by the identity of its storage
    (not by address: an empty tensor has none, and freed memory is reused)."""
    return t.untyped_storage()._cdata, t.storage_offset() * t.element_size()
