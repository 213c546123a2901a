"""Tables of entries in TOML or JSON files, chosen by the file's suffix: read, write, and name-checked."""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable
from typing import Any

from seqify.errors import ConfigError

__all__ = ["read_table", "write_table", "toml_text", "refuse_unknown"]


def _kind(path: str) -> str:
    return "toml" if path.lower().endswith(".toml") else "json"


def read_table(path: str | os.PathLike[str], what: str = "configuration") -> dict[str, Any]:
    """The table a ``.toml`` file (TOML) or any other file (JSON) holds; :class:`ConfigError` when it is
    missing, unreadable or not a table."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(f"{what} file {path!r} does not exist; give the path of a .toml or .json file")
    kind = _kind(path)
    try:
        if kind == "toml":
            import tomllib

            with open(path, "rb") as f:
                data: Any = tomllib.load(f)
        else:
            with open(path) as f:
                data = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError) as e:  # json and toml decode errors are ValueErrors
        raise ConfigError(f"{what} file {path!r} is not valid {kind.upper()}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} file {path!r} must hold a table of entries, not a {type(data).__name__}")
    return data


def write_table(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    """Write ``data`` as TOML to a ``.toml`` path (entries that are ``None`` are left out), else as JSON."""
    path = os.fspath(path)
    text = toml_text(data) if _kind(path) == "toml" else json.dumps(data, indent=1) + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def toml_text(data: dict[str, Any], prefix: str = "") -> str:
    """``data`` as TOML: plain entries first, then a ``[table]`` per dict and a ``[[table]]`` per dict of a
    list of dicts; ``None`` has no TOML form and is left out."""
    plain = [f"{_key(k)} = {_value(v)}" for k, v in data.items() if v is not None and not _is_tables(v)
             and not isinstance(v, dict)]
    parts = ["\n".join(plain)] if plain else []
    for k, v in data.items():
        name = f"{prefix}{_key(k)}"
        if isinstance(v, dict):
            parts.append(f"[{name}]\n" + toml_text(v, name + "."))
        elif _is_tables(v):
            parts.extend(f"[[{name}]]\n" + toml_text(item, name + ".") for item in v)
    return "\n\n".join(p.rstrip("\n") for p in parts) + "\n"


def _is_tables(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(v, dict) for v in value)


def _key(key: str) -> str:
    return key if key and all(c.isalnum() or c in "_-" for c in key) and key.isascii() else _string(key)


def _string(text: str) -> str:
    escapes = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}
    return '"' + "".join(escapes.get(c, f"\\u{ord(c):04x}" if ord(c) < 32 or ord(c) == 127 else c)
                         for c in text) + '"'


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)  # 0.25, 1e-05, inf, -inf, nan: each is TOML as Python writes it
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_value(v)}" for k, v in value.items() if v is not None) + " }"
    raise ConfigError(f"cannot write {value!r} (a {type(value).__name__}) to TOML")


def refuse_unknown(given: Iterable[str], known: Iterable[str], where: str) -> None:
    """:class:`ConfigError` naming the entries of ``given`` that are not ``known``, the nearest known name
    for each, and every known name."""
    known = sorted(known)
    unknown = sorted(set(given) - set(known))
    if not unknown:
        return
    close = {u: difflib.get_close_matches(u, known, n=1, cutoff=0.6) for u in unknown}
    hints = ", ".join(f"{u!r} -> {c[0]!r}" for u, c in close.items() if c)
    raise ConfigError(f"{where}: unknown entries {unknown}" + (f" (did you mean {hints}?)" if hints else "")
                      + f"; the entries are {known}")
