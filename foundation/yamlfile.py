"""The one YAML reader for files a person hands gpuguard (`--config`, runbooks, log-step specs).

Why one reader: each caller used to read its file its own way, and each missed something an
operator meets or an attacker tries: a FIFO or `/dev/zero` named as the config (a read that never
ends), a file of gigabytes, a repeated key that silently wins (a second `drain:` overriding the one
a reviewer read), `.nan` or `.inf` accepted as a threshold, and YAML aliases nested into a
"billion laughs" document (a few hundred bytes that unfold into 10**9 nodes for any walk or repr).
Here: the file is opened without blocking and must be a regular file, at most `max_bytes`, UTF-8;
parsed with `yaml.SafeLoader` (plain data only) that refuses duplicate keys and non-finite numbers
(naming the line); the result is measured unfolded (`foundation.unpickle.check_bounded`: aliases
are shared references) and refused past `MAX_NODES` nodes, 100 levels or a cycle. Every refusal is
one `DataError` line (exit 65) unless the caller names its own error class.

Lazy imports (start-up time): yaml, only when a file is read.
"""

from __future__ import annotations

import math
import os
from typing import Any

from gpuguard.foundation.boundedread import read_bytes, size_text
from gpuguard.foundation.errors import DataError, GpuguardError
from gpuguard.foundation.unpickle import Unbounded, check_bounded

DEFAULT_MAX_BYTES = 1 << 20
"""1 MiB: the largest config or runbook gpuguard ships is under 8 KiB."""
MAX_NODES = 1_000_000
"""Nodes of the unfolded document (aliases expanded): a 1 MiB file without aliases has fewer."""


def read_capped(
    path: str | os.PathLike[str],
    *,
    max_bytes: int,
    what: str,
    error: type[GpuguardError] = DataError,
    follow_links: bool = True,
) -> bytes:
    """At most `max_bytes` bytes of a regular file: `foundation.boundedread.read_bytes`, the one
    bounded reader (a FIFO, device or directory refused at once; with `follow_links=False` a link)."""
    return read_bytes(path, max_bytes=max_bytes, what=what, error=error, follow_links=follow_links)


def load_yaml(
    path: str | os.PathLike[str],
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    what: str = "a config file",
    error: type[GpuguardError] = DataError,
    finite: bool = True,
) -> Any:
    """The plain data of the YAML file at `path`, read under every rule above (`error` otherwise).

    `finite=False` leaves `.nan`/`.inf` to the caller (a caller that names the field in its message).
    """
    raw = read_capped(path, max_bytes=max_bytes, what=what, error=error)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{path}: not UTF-8 text") from None
    return parse_yaml(text, source=str(path), max_bytes=max_bytes, what=what, error=error, finite=finite)


def parse_yaml(
    text: str,
    *,
    source: str,
    max_bytes: int = DEFAULT_MAX_BYTES,
    what: str = "a config file",
    error: type[GpuguardError] = DataError,
    finite: bool = True,
) -> Any:
    """`load_yaml` for text already in hand (a packaged resource): the same rules but the file's."""
    import yaml  # noqa: PLC0415 - lazy: start-up time of gpu-doctor from cron

    if len(text) > max_bytes or len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise error(f"{source}: more than the {size_text(max_bytes)} {what} may have")
    try:
        doc = yaml.load(text, Loader=_loader(finite))  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        why = str(getattr(exc, "problem", None) or exc).replace("\n", " ")
        raise error(f"{source}: not valid YAML{where}: {why}") from None
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:
        first = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
        raise error(f"{source}: not valid YAML: {first}") from None
    try:
        check_bounded(doc, max_nodes=MAX_NODES, what="the document")
    except Unbounded as exc:
        raise error(f"{source}: refused: {exc} (YAML aliases)") from None
    return doc


_LOADERS: dict[bool, Any] = {}


def _loader(finite: bool) -> Any:
    """yaml.SafeLoader refusing a mapping that repeats a key (safe_load keeps the last silently) and,
    when `finite`, a float that is not finite (`.nan`, `.inf`, `1e999`)."""
    cached = _LOADERS.get(finite)
    if cached is not None:
        return cached
    import yaml  # noqa: PLC0415 - lazy: start-up time of gpu-doctor from cron

    class StrictSafeLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            if isinstance(node, yaml.MappingNode):
                seen: dict[Any, int] = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue  # `<<:` merges may be overridden, as YAML says
                    if not isinstance(key_node, yaml.ScalarNode):
                        continue  # complex keys: the base class refuses unhashable ones
                    key = self.construct_object(key_node, deep=True)
                    try:
                        first = seen.get(key)
                    except TypeError:
                        continue
                    if first is not None:
                        shown = repr(key[:40]) if isinstance(key, str) else repr(key)[:40]
                        raise yaml.constructor.ConstructorError(
                            "while constructing a mapping",
                            node.start_mark,
                            f"duplicate key {shown} (first at line {first + 1})",
                            key_node.start_mark,
                        )
                    seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep=deep)

    if finite:

        def construct_finite_float(loader: Any, node: Any) -> float:
            value = yaml.SafeLoader.construct_yaml_float(loader, node)
            if not math.isfinite(value):
                raise yaml.constructor.ConstructorError(
                    None, None, f"{str(node.value)[:40]!r} is not a finite number", node.start_mark
                )
            return float(value)

        StrictSafeLoader.add_constructor("tag:yaml.org,2002:float", construct_finite_float)

    _LOADERS[finite] = StrictSafeLoader
    return StrictSafeLoader
