"""Plain human output that fits the terminal: lines broken between words with a hanging indent.

Why: on-call reads these pages at 80 columns, and the terminal (or rich's folding) broke long lines in
the middle of a number, a digest or a path. Every plain-text page goes through `echo`/`echo_lines`: a
line longer than the width is broken at spaces only, its continuation indented under the line's own
text (after a `label     ` column where there is one), and a token is never split (one longer than
the width stands alone on its line). Digests are shown as their first `DIGEST` hex digits (`short`);
`--json` has them whole.

The width: $COLUMNS, else the terminal's; piped without $COLUMNS nothing is broken (one record per
line for grep). Standard library only: the fast path (`cli._fast`) prints through it too.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import textwrap
from collections.abc import Iterable
from typing import TextIO

DIGEST = 12  # hex digits of a digest in human output
NARROW = 120  # below this many columns, tables become one line per row (wrapped with a hanging indent)
_LABEL = re.compile(r"^( *)(\S(?:.*?\S)?)( {2,})(?=\S)")  # "label    value": continuations align on value


def columns() -> int | None:
    """The width human output may use: $COLUMNS, else the terminal's; None when piped (never broken)."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) >= 20:
        return int(env)
    try:
        if sys.stdout.isatty():
            return shutil.get_terminal_size().columns
    except (AttributeError, ValueError, OSError):
        pass
    return None


def short(digest: object) -> str:
    """A digest as shown to a person: its first `DIGEST` hex digits."""
    return str(digest)[:DIGEST]


def hang_of(line: str) -> int:
    """Where a broken line's continuations start: under the value of a `label    value` line whose label
    column is at most a third of the line, else two past the line's own indent."""
    m = _LABEL.match(line)
    if m is not None and len(m.group(0)) <= 24:
        return len(m.group(0))
    return len(line) - len(line.lstrip(" ")) + 2


def wrap(line: str, width: int | None, hang: int | None = None) -> list[str]:
    """`line` broken at spaces to `width` (None: not at all), continuations indented by `hang` (default
    `hang_of`); no token is ever split."""
    if width is None or len(line) <= width:
        return [line]
    indent = len(line) - len(line.lstrip(" "))
    hang = hang_of(line) if hang is None else hang
    hang = min(hang, max(indent, width // 3))
    wrapper = textwrap.TextWrapper(
        width=width,
        initial_indent=" " * indent,
        subsequent_indent=" " * hang,
        break_long_words=False,
        break_on_hyphens=False,
        replace_whitespace=False,
        drop_whitespace=True,
    )
    head = _LABEL.match(line)
    if head is not None and len(head.group(0)) == hang:  # keep the label's own spacing on the first line
        rest = wrapper.wrap(" " * hang + line[hang:].lstrip(" "))
        return [line[:hang] + rest[0].lstrip(" "), *rest[1:]] if rest else [line]
    return wrapper.wrap(line[indent:]) or [line]


def lines_for(lines: Iterable[str], width: int | None = None) -> list[str]:
    """Every line wrapped to `width` (default: `columns()`)."""
    w = columns() if width is None else width
    return [part for line in lines for part in wrap(line, w)]


def echo(line: str = "", *, hang: int | None = None, file: TextIO | None = None) -> None:
    """Print one line, broken to the width (see `wrap`)."""
    out = sys.stdout if file is None else file
    for part in wrap(line, columns(), hang):
        print(part, file=out)


def echo_lines(lines: Iterable[str], *, file: TextIO | None = None) -> None:
    for line in lines:
        echo(line, file=file)


def say(out: object, line: str, *, hang: int | None = None) -> None:
    """Print one line on a rich console, broken to the width here (rich's own wrapping folds a token)."""
    for part in wrap(line, columns(), hang):
        out.print(part, markup=False, soft_wrap=True, highlight=False)  # type: ignore[attr-defined]
