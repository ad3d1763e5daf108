"""Plain str / int / float / bool options without pydantic.

typer 0.29 coerces every non-bool option value through a pydantic `TypeAdapter`, which imports
pydantic (0.25 s on an idle core here, up to 0.9 s under load) on *every* command run. A cron sweep on
10,000 nodes cannot pay that for converting "10" into 10.0. `install()` swaps in a tiny coercion for
the plain annotations (str, int, float, bool, their Optional, list of them) and leaves everything else
(paths, choices, ranges, files, datetimes, enums) to typer's own code, unchanged. A float option,
plain or ranged, is a finite number: `nan` and `inf` are usage errors (a NaN cost or an infinite
grace would turn into nonsense or a wait forever).

It patches a private hook (`typer.core.build_runtime_param`), so pyproject.toml bounds typer to the
minor version it was written for, and tests/cli/test_fastparams.py fails when the patch does not take.
"""

from __future__ import annotations

import math
import types
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin

_SIMPLE = (str, int, float, bool)
_BOOL = {
    "1": True,
    "true": True,
    "t": True,
    "yes": True,
    "y": True,
    "on": True,
    "0": False,
    "false": False,
    "f": False,
    "no": False,
    "n": False,
    "off": False,
}
_installed = False


def _plain(annotation: Any) -> tuple[type, bool] | None:
    """(scalar type, is_list) for str/int/float/bool, Optional[...] and list[...] of them; else None."""
    many = False
    if get_origin(annotation) is list:
        (annotation,) = get_args(annotation) or (None,)
        many = True
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) != 1:
            return None
        annotation = args[0]
    if annotation in _SIMPLE:
        return annotation, many
    return None


def installed() -> bool:
    """Did `install()` take effect (typer's layout was the one this patch knows)?"""
    return _installed


def install() -> None:
    """Patch typer once (idempotent). Falls back to typer's coercion for anything not plain."""
    global _installed
    if _installed:
        return
    try:
        from typer import _coercion, core
        from typer._click.exceptions import BadParameter
    except ImportError:  # another typer layout: keep its behaviour
        return
    original = getattr(core, "build_runtime_param", None)
    base = getattr(_coercion, "RuntimeParam", None)
    if original is None or base is None:
        return

    @dataclass(frozen=True)
    class PlainRuntimeParam(base):  # type: ignore[misc, valid-type]
        kind: type = str
        many: bool = False

        def _one(self, value: Any, param: Any, ctx: Any) -> Any:
            if isinstance(value, self.kind) and (self.kind is bool or not isinstance(value, bool)):
                return value
            if self.kind is bool:
                if str(value).strip().lower() in _BOOL:
                    return _BOOL[str(value).strip().lower()]
                raise BadParameter(f"{value!r} is not a valid boolean.", ctx=ctx, param=param)
            try:
                converted = self.kind(value)
            except (TypeError, ValueError):
                raise BadParameter(f"{value!r} is not a valid {self.kind.__name__}.", ctx=ctx, param=param) from None
            return _finite(converted, param, ctx)

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            if self.many:
                return [self._one(v, param, ctx) for v in value]
            return self._one(value, param, ctx)

    @dataclass(frozen=True)
    class FiniteRuntimeParam(base):  # type: ignore[misc, valid-type]
        """typer's own coercion of a ranged float, then the finiteness check."""

        inner: Any = None

        def _coerce_value(self, value: Any, param: Any, ctx: Any) -> Any:
            value = self.inner._coerce_value(value, param, ctx)  # noqa: SLF001 - typer's coercion hook, the one this class overrides
            if isinstance(value, list):
                return [_finite(v, param, ctx) for v in value]
            return _finite(value, param, ctx)

    def _finite(value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            raise BadParameter(f"{value!r} is not a finite number.", ctx=ctx, param=param)
        return value

    def build(descriptor: Any) -> Any:
        plain = _plain(descriptor.annotation)
        info = descriptor.parameter_info
        if plain is not None and plain[0] is float and descriptor.is_ranged:
            inner = original(descriptor)
            return FiniteRuntimeParam(parameter_info=info, annotation=descriptor.annotation, inner=inner)
        if (
            plain is None
            or descriptor.file_annotation is not None
            or getattr(info, "parser", None) is not None
            or getattr(info, "click_type", None) is not None
            or descriptor.is_ranged
            or descriptor.is_choice
            or descriptor.is_path
        ):
            return original(descriptor)
        return PlainRuntimeParam(parameter_info=info, annotation=descriptor.annotation, kind=plain[0], many=plain[1])

    core.build_runtime_param = build
    _installed = True
