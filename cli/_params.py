"""What an option's value is: its metavar in --help and what the shell completions offer for it.

Why one place: typer shows a value it knows nothing about as `<str>`, `<float range>` or `<list[int]>`,
and the completion scripts offered option names (a bare `-` inserted) where a value belongs. Both now
read `value_kind`: a choice (`a|b|c`, completed from the list), a file or a directory (completed from
the file system), or a free value named by what it is (`N`, `S`, `HOST:PORT`: nothing to complete).

The metavar a command declares wins; `a|b|c` declares a choice, `FILE…`/`PATH…`/`YAML`/`JSON` a file,
`DIR` a directory. Without one the type decides (typer's `type_descriptor`, read with getattr: another
typer leaves the metavar as it was).
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

RUNBOOK_METAVAR = "RUNBOOK|FILE"  # a built-in runbook's name (completed from the bundled ones) or a YAML file
_CHOICES = re.compile(r"[a-z0-9][a-z0-9_-]*(\|[a-z0-9][a-z0-9_-]*)+")
_FILE_METAVARS = ("FILE", "PATH", "YAML", "JSON")
_SECONDS = ("timeout", "grace", "deadline", "interval", "wait", "cost", "latency", "blocking")


class ValueKind(NamedTuple):
    """An option's (or argument's) value: the metavar shown and what completes it."""

    metavar: str
    choices: tuple[str, ...] = ()
    files: bool = False
    dirs: bool = False


def _from_metavar(metavar: str) -> ValueKind:
    bare = metavar.removesuffix("...")
    if bare == RUNBOOK_METAVAR:
        from gpuguard.recovery.operator.runbooks import builtin_names  # only where completions are made

        return ValueKind(metavar, choices=tuple(builtin_names()), files=True)
    if _CHOICES.fullmatch(bare):
        return ValueKind(metavar, choices=tuple(c for c in bare.split("|") if c != "-"))
    if bare.startswith("DIR"):
        return ValueKind(metavar, dirs=True)
    if bare.startswith(_FILE_METAVARS):
        return ValueKind(metavar, files=True)
    return ValueKind(metavar)


def _name(param: Any) -> str:
    opts = [o for o in getattr(param, "opts", ()) if o.startswith("--")]
    return (opts[0][2:] if opts else str(getattr(param, "name", "") or "value")).replace("_", "-")


def _from_type(param: Any) -> ValueKind | None:
    """The kind typer's type descriptor implies, or None when this typer has none."""
    desc = getattr(param, "type_descriptor", None)
    if desc is None:
        return None
    name = _name(param)
    many = "..." if getattr(param, "nargs", 1) != 1 else ""
    choices = getattr(desc, "choices", None)
    if choices:
        values = tuple(str(getattr(c, "value", c)) for c in choices)
        return ValueKind("|".join(values) + many, choices=values)
    if getattr(desc, "is_path", False):
        if name.endswith(("-dir", "-root")) or name in ("dir", "root"):
            return ValueKind("DIR" + many, dirs=True)
        return ValueKind("PATH" + many, files=True)
    annotation = getattr(desc, "annotation", None)
    element = (getattr(annotation, "__args__", None) or (annotation,))[0]
    if element is int:
        return ValueKind("N" + many)
    if element is float:
        return ValueKind(("S" if name.endswith(_SECONDS) else "X") + many)
    return ValueKind(name.rsplit("-", 1)[-1].upper() + many)


def value_kind(param: Any) -> ValueKind | None:
    """What `param` takes: None for a flag (`--json`, `--yes`)."""
    if getattr(param, "is_flag", False) or getattr(param, "count", False):
        return None
    metavar = getattr(param, "metavar", None)
    if metavar:
        return _from_metavar(metavar)
    return _from_type(param) or ValueKind(_name(param).upper())


def _no_type(ctx: Any = None) -> None:
    return None


def name_values(command: Any) -> Any:
    """Give every option of the tree without a metavar the one `value_kind` names (arguments keep
    their names: `NAME`, `FILES...`)."""
    for param in getattr(command, "params", ()):
        if getattr(param, "param_type_name", "") != "option":
            if getattr(param, "metavar", None) and hasattr(param, "display_type_rich"):
                param.display_type_rich = _no_type  # typer adds `<list[str]>` after an argument's own name
            continue
        kind = value_kind(param)
        if kind is not None and not getattr(param, "metavar", None):
            param.metavar = kind.metavar
    for sub in (getattr(command, "commands", None) or {}).values():
        name_values(sub)
    return command
