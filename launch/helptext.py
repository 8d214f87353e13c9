"""``python launch/train.py --help``: usage and every config key, generated from the config
dataclasses (``launch.config.TrainConfig`` and the sections it holds) so it cannot drift.

A key's description is the comment on its line in the dataclass source, else the comment lines
right above it; its default is the dataclass default; an Enum key lists its values.
"""
from __future__ import annotations

import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
import typing
from enum import Enum


def field_comments(cls) -> dict[str, str]:
    """{field name: its comment} from ``cls``'s own source (trailing comment, else the block of
    comment lines above the field). Fields without either are left out."""
    try:
        src = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source (built in a REPL): no descriptions
        return {}
    lines = src.splitlines()
    names = {f.name for f in dataclasses.fields(cls)}
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT:
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}
    for i, line in enumerate(lines, start=1):
        stripped = line.strip()
        name = stripped.split(":", 1)[0].strip()
        if line.startswith("    ") and not line.startswith("     ") and name in names \
                and ":" in stripped and name not in out:
            if i in trailing and not stripped.startswith("#"):
                out[name] = trailing[i]
                continue
            above, j = [], i - 1
            while j >= 1 and lines[j - 1].strip().startswith("#"):
                above.insert(0, lines[j - 1].strip().lstrip("#").strip())
                j -= 1
            if above:
                out[name] = " ".join(above)
    return out


def _fmt_default(value) -> str:
    if isinstance(value, Enum):
        return repr(value.value) if isinstance(value.value, str) else str(value.value)
    if isinstance(value, str):
        return repr(value)
    return str(value).replace("\n", " ")


def first_sentence(text: str) -> str:
    """One line: the text up to its first full stop (long field comments explain more)."""
    m = re.search(r"[^.]\.\s", text)  # not ".." (a range: "k+1 .. k+s")
    return text if m is None else text[:m.start() + 2]


def _type_name(kind) -> str:
    return getattr(kind, "__name__", None) or str(kind).replace("typing.", "")


def config_keys(cls, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted key, default, description) for every leaf of the dataclass ``cls``, in order."""
    hints = typing.get_type_hints(cls)
    defaults = cls()
    comments = field_comments(cls)
    rows = []
    for f in dataclasses.fields(cls):
        key, value = f"{prefix}{f.name}", getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            rows += config_keys(type(value), key + ".")
            continue
        kind = hints.get(f.name)
        desc = first_sentence(comments.get(f.name, "")) or f"({_type_name(kind)})"
        if isinstance(kind, type) and issubclass(kind, Enum):
            choices = "|".join(str(m.value) for m in kind)
            desc = f"{desc} [{choices}]" if desc else f"[{choices}]"
        rows.append((key, _fmt_default(value), desc))
    return rows


def usage(doc: str | None = None) -> str:
    """The script's docstring (how to call it), then every key as ``key = default  # what``."""
    from launch.config import CONFIG_DIR, TrainConfig

    head = (doc or "").strip()
    rows = config_keys(TrainConfig)
    width = max(len(f"{k} = {d}") for k, d, _ in rows)
    body = [f"  {k} = {d}".ljust(width + 4) + (f"# {c}" if c else "").rstrip() for k, d, c in rows]
    presets = ", ".join(sorted(p.name for p in CONFIG_DIR.glob("*.yaml")))
    return "\n".join([head, "",
                      "Options: --config FILE.yaml (presets merge in order; default: "
                      "launch/configs/default.yaml), key=value overrides, -h/--help.",
                      f"Presets in {CONFIG_DIR}: {presets}", "",
                      "Config keys (dataclass defaults; launch/configs/default.yaml overrides some):",
                      *(line.rstrip() for line in body)]) + "\n"
