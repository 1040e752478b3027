"""Function surgery on the forwards of models we did not write: finding the function of a
module's class forward (through its decorators) that calls a given global, copying it
with other globals or code, rebuilding the decorators around the copy, and reading its
source back as the code Python compiled (so that a rewrite starts from the very
statements that run)."""

from __future__ import annotations

import ast
import dis
import inspect
import sys
import textwrap
import types
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = [
    "bound_on_instance",
    "called_function",
    "calling_source",
    "class_forward",
    "copy_function",
    "function_code",
    "module_namespace",
    "parsed_source",
    "rebuilt",
]


def called_function(module: nn.Module, name: str) -> Any:
    """What ``module``'s class forward (through its decorators) calls as the global
    ``name``; None where it calls no such name, or a forward is bound on the instance."""
    chain = class_forward(module, lambda f: name in f.__code__.co_names)
    return None if chain is None else chain[-1].__globals__.get(name)


def calling_source(module: nn.Module, name: str) -> str | None:
    """The source of the function in ``module``'s class forward (through its decorators)
    that calls the global ``name``; None where there is none or it cannot be read."""
    chain = class_forward(module, lambda f: name in f.__code__.co_names)
    if chain is None:
        return None
    try:
        return inspect.getsource(chain[-1])
    except (OSError, TypeError):
        return None


def bound_on_instance(module: nn.Module) -> bool:
    """Whether a forward other than its class's own is bound on ``module`` itself (ours,
    or someone else's). An optimized model saved whole (``torch.save``) loads with its
    class's own forward bound there, as pickle rebuilds bound methods by name."""
    bound = module.__dict__.get("forward")
    if bound is None:
        return False
    return getattr(bound, "__func__", None) is not getattr(type(module), "forward", None)


def class_forward(
    module: nn.Module, found: Callable[[types.FunctionType], bool]
) -> list[types.FunctionType] | None:
    """:func:`_decorated` of ``module``'s class's forward; None where a forward is bound
    on the instance already (ours, or the user's)."""
    if bound_on_instance(module):
        return None
    return _decorated(getattr(type(module), "forward", None), found)


def _decorated(
    function: Any, found: Callable[[types.FunctionType], bool]
) -> list[types.FunctionType] | None:
    """The functions from ``function`` down through its decorators (each holding the
    next in a closure cell) to the one ``found`` accepts; None where there is none."""
    chain: list[types.FunctionType] = []
    while isinstance(function, types.FunctionType) and len(chain) < 8:
        chain.append(function)
        if found(function):
            return chain
        inner = getattr(function, "__wrapped__", None)
        cells = [c.cell_contents for c in function.__closure__ or () if _filled(c)]
        if inner is None or not any(c is inner for c in cells):
            return None  # not a decorator holding it in a cell: nothing to rebuild
        function = inner
    return None


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def rebuilt(chain: list[types.FunctionType], function: types.FunctionType) -> types.FunctionType:
    """A copy of ``chain[0]`` calling ``function`` where the original called ``chain[-1]``
    (each decorator layer rebuilt around the new inner one)."""
    for outer, old in zip(reversed(chain[:-1]), reversed(chain[1:])):
        closure = tuple(
            types.CellType(function) if _filled(c) and c.cell_contents is old else c
            for c in outer.__closure__ or ()
        )
        wrapped, function = function, copy_function(outer, outer.__globals__, closure)
        function.__wrapped__ = wrapped  # the copy it calls, for inspect
    return function


_NAMESPACES: dict[tuple, dict[str, Any]] = {}


def module_namespace(module_globals: dict[str, Any], names: dict[str, Any]) -> dict[str, Any]:
    """The globals of a modeling file with ``names`` set in them (our
    ``apply_rotary_pos_emb``, our residual helper): a module of its own in
    ``sys.modules`` (one per modeling file and set of names), so that torch.compile,
    which finds a function's globals by its module's name, guards on this namespace and
    not on the modeling file's."""
    key = (module_globals.get("__name__", "?"), *sorted((k, id(v)) for k, v in names.items()))
    namespace = _NAMESPACES.get(key)
    if namespace is None:
        name = f"xpuruntime.pytorch._bound.{key[0]}.{len(_NAMESPACES)}"
        module = types.ModuleType(name)
        module.__dict__.update({k: v for k, v in module_globals.items() if k != "__name__"})
        module.__dict__.update(names)
        sys.modules[name] = module
        namespace = _NAMESPACES[key] = module.__dict__
    return namespace


def copy_function(function: types.FunctionType, globals_: dict, closure: Any) -> types.FunctionType:
    copied = types.FunctionType(
        function.__code__, globals_, function.__name__, function.__defaults__, closure
    )
    copied.__kwdefaults__ = function.__kwdefaults__
    copied.__dict__.update(function.__dict__)
    copied.__qualname__ = function.__qualname__
    return copied


def parsed_source(code: types.CodeType) -> tuple[ast.Module, ast.FunctionDef] | None:
    """The module of one definition holding the source of the function ``code``
    belongs to, and that definition, to rewrite and compile again: no decorators, no
    annotations, the file's line numbers. None where the source cannot be read, or read
    is not the code that runs (a file changed on disk since it was imported)."""
    try:
        lines, first = inspect.getsourcelines(code)
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    definition = tree.body[0] if tree.body else None
    if not isinstance(definition, ast.FunctionDef) or definition.name != code.co_name:
        return None
    # The definition alone, as the original's code: no decorators (the chain above is
    # rebuilt around it), no annotations to evaluate, the file's line numbers.
    definition.decorator_list = []
    definition.returns = None
    arguments = definition.args
    for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                     arguments.vararg, arguments.kwarg):  # fmt: skip
        if argument is not None:
            argument.annotation = None
    ast.increment_lineno(tree, first - 1)
    # Compiled as it stands, the source read gives the same instructions as the code.
    as_read = function_code(tree, code)
    if as_read is None or _instructions(as_read) != _instructions(code):
        return None
    return tree, definition


_JUMPS = frozenset(dis.hasjrel) | frozenset(dis.hasjabs)


def _instructions(code: types.CodeType) -> list[tuple[str, Any]]:
    """What ``code`` does, as compared with the same source compiled again on its own:
    each instruction and its argument, except what depends on the module it was compiled
    in (a method call on an imported name compiles as an attribute load and a call, not
    a method load) and what follows from that (jump offsets); nested code likewise."""
    out = []
    for i in dis.get_instructions(code):
        name = "LOAD_ATTR" if i.opname == "LOAD_METHOD" else i.opname
        if i.opcode in _JUMPS:
            out.append((name, None))
        elif isinstance(i.argval, types.CodeType):
            out.append((name, tuple(_instructions(i.argval))))
        else:
            out.append((name, i.argval))
    return out


def function_code(
    tree: ast.Module, code: types.CodeType, name: str | None = None
) -> types.CodeType | None:
    """The code of the function named ``name`` (by default as ``code``) that ``tree``
    defines, compiled as from ``code``'s file."""
    try:
        compiled = compile(tree, code.co_filename, "exec")
    except (SyntaxError, ValueError):
        return None
    return next(
        (
            c
            for c in compiled.co_consts
            if isinstance(c, types.CodeType) and c.co_name == (name or code.co_name)
        ),
        None,
    )
