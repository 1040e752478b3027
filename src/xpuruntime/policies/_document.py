"""Reading, writing and fingerprinting policy documents (JSON or YAML)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .._errors import PolicyError, shown
from .._files import atomic_write_text, read_regular_file

__all__ = [
    "canonical_json",
    "fingerprint_of",
    "read_document",
    "unknown_fields",
    "write_document",
]

_FORMATS = {".json": "json", ".yaml": "yaml", ".yml": "yaml"}


def canonical_json(data: dict[str, Any]) -> str:
    """The one textual form a policy is hashed in: sorted keys, no whitespace."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def fingerprint_of(data: dict[str, Any]) -> str:
    """SHA-256 of :func:`canonical_json`, as 16 hex digits."""
    return hashlib.sha256(canonical_json(data).encode("ascii")).hexdigest()[:16]


def unknown_fields(unknown: set[str], fields: list[str] | tuple[str, ...]) -> str:
    """``unknown field(s) [...]``, each with the field it may have meant, then the fields
    expected."""
    import difflib

    named = []
    for name in sorted(unknown):
        close = difflib.get_close_matches(name, fields, n=1)
        named.append(f"{name!r} (did you mean {close[0]!r}?)" if close else repr(name))
    return f"unknown field(s) {', '.join(named)}; expected some of {list(fields)}"


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object's pairs as a dict, refusing a key given twice (JSON would keep the
    last silently)."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"the key {key!r} is given twice")
        data[key] = value
    return data


def _format_for(path: Path, fmt: str | None) -> str:
    if fmt is not None:
        if fmt not in ("json", "yaml"):
            raise PolicyError(f"format: expected 'json' or 'yaml', got {shown(fmt)}")
        return fmt
    try:
        return _FORMATS[path.suffix.lower()]
    except KeyError:
        raise PolicyError(
            f"{path}: cannot tell the format from the suffix {shown(path.suffix)}; "
            f"expected one of {sorted(_FORMATS)} or pass format='json'|'yaml'"
        ) from None


def write_document(path: str | os.PathLike[str], data: dict[str, Any], fmt: str | None) -> Path:
    """Write ``data`` atomically as JSON or YAML (chosen by ``fmt`` or the suffix)."""
    path = Path(path)
    if _format_for(path, fmt) == "json":
        text = json.dumps(data, indent=2, sort_keys=True) + "\n"
    else:
        import yaml

        text = yaml.safe_dump(data, sort_keys=True, default_flow_style=False)
    return atomic_write_text(path, text)


POLICY_FILE_LIMIT = 1 << 20
"""Bytes a policy file may have: policies are a few hundred bytes."""


def _loader() -> type:
    """yaml's SafeLoader without aliases: an alias lets a few hundred bytes stand for
    gigabytes once the value is printed or hashed (a "billion laughs"), and a policy has
    no use for one."""
    global _NoAliasLoader
    if _NoAliasLoader is None:
        import yaml

        class NoAliasLoader(yaml.SafeLoader):
            def compose_node(self, parent: Any, index: Any) -> Any:
                if self.check_event(yaml.events.AliasEvent):
                    event = self.peek_event()
                    raise yaml.composer.ComposerError(
                        None, None, "aliases (*name) are not allowed in a policy", event.start_mark
                    )
                return super().compose_node(parent, index)

            def construct_mapping(self, node: Any, deep: bool = False) -> Any:
                keys = [self.construct_object(k, deep=deep) for k, _ in node.value]
                twice = sorted({str(k) for k in keys if keys.count(k) > 1})
                if twice:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key(s) {twice} are given twice", node.start_mark
                    )
                return super().construct_mapping(node, deep=deep)

        _NoAliasLoader = NoAliasLoader
    return _NoAliasLoader


_NoAliasLoader: type | None = None


def read_document(path: str | os.PathLike[str], fmt: str | None = None) -> dict[str, Any]:
    """Read a JSON or YAML mapping; any problem is a :class:`PolicyError` naming the file."""
    path = Path(path)
    kind = _format_for(path, fmt)
    try:
        text = read_regular_file(path, POLICY_FILE_LIMIT, "policy file").decode("utf-8")
    except FileNotFoundError:
        raise PolicyError(f"{path}: policy file not found") from None
    except ValueError as e:  # not a regular file, too large, not UTF-8
        raise PolicyError(f"{path}: cannot read policy file: {e}") from None
    except OSError as e:
        raise PolicyError(f"{path}: cannot read policy file: {e}") from e
    try:
        if kind == "json":
            data = json.loads(text, object_pairs_hook=_unique_keys)
        else:
            import yaml

            data = yaml.load(text, Loader=_loader())
    except (json.JSONDecodeError, ValueError) as e:
        raise PolicyError(f"{path}: malformed {kind.upper()}: {e}") from e
    except Exception as e:  # yaml.YAMLError and its subclasses
        raise PolicyError(f"{path}: malformed {kind.upper()}: {e}") from e
    if not isinstance(data, dict):
        raise PolicyError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data
