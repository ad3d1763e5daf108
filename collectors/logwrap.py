"""Pasted logs: re-join lines a terminal or a ticket wrapped, so an event split over lines is still read.

Why: on-call engineers paste a rank's stderr into a ticket or copy it out of an 80/100-column terminal,
and a watchdog line cut mid-token (`... ran for 600043 mil` / `liseconds before timing out.`) gives no
event at all. Pastes also carry prefixes the parser does not need: ticket line numbers (`  41 | `),
`stderr:` / `stdout:`, mpirun's `[1,0]<stderr>:`, Ray's `(RayTrainWorker pid=3312, ip=...)` and the
remnants of ANSI colour codes (`\x1b[31m`, or `[0m` once the escape byte is lost).

The rule, chosen so that nothing is invented across unrelated lines: a line is joined with the next
one, two or three lines only if (a) the line is long enough to have been wrapped, (b) each following
line is a *continuation* (it does not start like a new record: no timestamp, no `[`, no `file:line`,
no traceback line, no exception name, no shell prompt), and (c) the joined text gives an event that the
line alone does not. A line that ends with a colon and gives no event itself introduces the event on the
next line (a watchdog's `... operation timeout:` with its `WorkNCCL(...)` on a line of its own): joined,
when that reads the same event with more fields (its rank). Otherwise every line is parsed exactly as `logparse.iter_events` parses it.
Joined events keep the number of their first line. Only small inputs (a paste, `MAX_BYTES`) take this
path; big files go through the fast scanner (`logscan`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from gpuguard.collectors.logparse import MAX_LINE, LogParser, _records, has_marker
from gpuguard.collectors.logrule import lazy_re
from gpuguard.foundation.events import Event

MAX_BYTES = 8 << 20  # inputs up to this size are read whole and re-joined
MIN_WRAPPED = 60  # a line shorter than this was not wrapped by a terminal or a ticket
MAX_JOIN = 3  # continuation lines joined to one record at most

_ANSI = lazy_re(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|(?<![\w\]])\[(?:\d{1,3};)*\d{1,3}m")
_PASTE_PREFIX = lazy_re(
    r"^(?:\s*\d{1,7}\s*[|│]\s?"  # ticket / editor line numbers: "  41 | "
    r"|\s*\d{1,7}:\s"  # "41: "
    r"|\[\d+,\d+\]<(?:stdout|stderr)>:\s?"  # mpirun --tag-output
    r"|(?:stderr|stdout):\s?"
    r"|\(\w+ pid=\d+(?:, ip=[0-9a-fA-F.:]+)?\)\s?"  # Ray worker prefix
    r")+"
)
_RECORD_START = lazy_re(
    r"^(?:\s*$|\s{2,}\S|\[|\d{4}-\d{2}-\d{2}|\d{2}:\d{2}:\d{2}|"
    r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) +\d|[EWIF]\d{4} \d|"
    r"[\w.-]+:\d+:\d+ |[\w./-]+\.(?:py|cc|cpp|cu|h):\d+|Traceback |File \"|[A-Z]\w*(?:Error|Exception|Warning)\b|"
    r"[$#] |terminate called|NCCL |NVRM|\w+ \d{2}:\d{2}|WARNING|ERROR|INFO|DEBUG|kernel: |[\w.-]+\[\d+\]: )"
)


def split_paste(data: bytes) -> tuple[list[str], int]:
    """The lines of a small input (decoded, replacement characters for invalid UTF-8; a last empty line
    dropped) and how many are unreadable: hold a marker but are not valid UTF-8 or are longer than
    `logparse.MAX_LINE` characters (the same count as `LogParser.unreadable` on the fast path)."""
    try:
        lines = data.decode("utf-8").split("\n")
        bad_bytes = False
    except UnicodeDecodeError:
        lines = data.decode("utf-8", "replace").split("\n")
        bad_bytes = True
    if lines and lines[-1] == "":
        lines.pop()
    if not bad_bytes and all(len(line) <= MAX_LINE for line in lines):
        return lines, 0
    unreadable = 0
    for raw in data.split(b"\n")[: len(lines)]:
        parts, bad = _records(raw)
        if bad is not None and any(b and has_marker(p) for p, b in zip(parts, bad)):
            unreadable += 1
    return lines, unreadable


def clean(line: str) -> str:
    """The line without ANSI colour codes (and their remnants) and paste prefixes."""
    if "\x1b" in line or "m" in line:
        line = _ANSI.sub("", line)
    return _PASTE_PREFIX.sub("", line, count=1)


def is_continuation(line: str) -> bool:
    """Could this line be the rest of the line before it (it does not start like a new record)?"""
    body = clean(line)
    return bool(body) and _RECORD_START.match(body) is None


def _strong_cut(text: str, nxt: str) -> bool:
    """Two lines that are each an event are one cut line only when the cut is unmistakable: the second
    starts with the punctuation or the single space that continues the first (`exception` + `: CUDA`)."""
    if not text:
        return False
    if text[-1] == " ":  # cut right after one space: `terminated with ` + `exception: CUDA error`
        if text[-2:-1] in (":", ",", ";", "="):  # `exception: ` + `CUDA error`
            return nxt[:1].isalnum()
        return not text[-2:-1].isspace() and nxt[:1].isalnum() and nxt[:1].islower()
    return nxt[:1] in tuple(":,;.)]}=/") or (nxt[:1] == " " and nxt[1:2].isalnum())


def _mid_token(text: str, nxt: str) -> bool:
    """The wrap cut a word in two (`...ProcessGroupNCCL'` + `s watchdog`, `mil` + `liseconds`), or cut
    right after one space in the middle of a sentence (`thread ` + `terminated`)."""
    if not text:
        return False
    if nxt[:1] == " " and nxt[1:2].isalnum():
        return not text[-1].isspace()  # cut right before a space: `terminated` + ` with exception`
    if text[-1] == " " and not text[-2:-1].isspace():
        return nxt[:1].isalnum()  # cut right after one space: `exception: ` + `CUDA error: ...`
    if text[-1].isspace():
        return False
    return (nxt[:1].isalnum() and nxt[:1].islower()) or (nxt[:1] in ":,;.)]}=/" and nxt[:1] != "")


def _alone(text: str) -> list[tuple[str, int]]:
    """(kind, number of non-null fields) of the events the text gives on its own."""
    parser = LogParser()
    return [(e.kind, sum(v is not None for v in e.fields.values())) for e in parser.feed(text, 1) + parser.close()]


def _is_intro(text: str) -> bool:
    """A line that ends with a colon and is no event itself (it introduces what follows)."""
    return text.rstrip().endswith(":") and not _alone(text)


def _introduced(lines: Sequence[str], i: int, head: str) -> tuple[str, int] | None:
    """A line that ends with a colon and is no event itself, followed by an event on the next line
    (`[rank3]:[E ...] [Rank 3] Watchdog caught collective operation timeout:` + `WorkNCCL(SeqNum=...)`,
    each `WorkNCCL(...)` on a line of its own): the head's context (the rank) belongs to the event below
    it. (joined text, 2) when the join reads the same event with more fields, else None."""
    if i + 1 >= len(lines) or not is_continuation(lines[i + 1]) or not _is_intro(head):
        return None
    if i > 0 and _is_intro(clean(lines[i - 1].rstrip("\r\n"))):
        return None  # several heads before the events (ranks interleaved): which event is whose is unknown
    nxt = clean(lines[i + 1].rstrip("\r\n"))
    alone = _alone(nxt)
    if not alone:
        return None
    text = head.rstrip() + " " + nxt
    found = _alone(text)
    if [k for k, _ in found] == [k for k, _ in alone] and sum(n for _, n in found) > sum(n for _, n in alone):
        return text, 2
    return None


def _join(lines: Sequence[str], i: int) -> tuple[str, int] | None:
    """(joined text, lines used) when joining `lines[i]` with what follows completes an event."""
    head = clean(lines[i].rstrip("\r\n"))
    introduced = _introduced(lines, i, head)
    if introduced is not None:
        return introduced
    if len(head) < MIN_WRAPPED:
        return None
    base = _alone(head)
    text = head
    for k in range(1, MAX_JOIN + 1):
        if i + k >= len(lines) or not is_continuation(lines[i + k]):
            return None
        nxt = clean(lines[i + k].rstrip("\r\n"))
        if has_marker(nxt) and _alone(nxt) and not (_strong_cut(text, nxt) if base else _mid_token(text, nxt)):
            return None  # a line that is evidence by itself is not swallowed into another one
        for sep in ("", " "):
            cand = text + sep + nxt
            if has_marker(cand):
                found = _alone(cand)
                if found and _better(found, base, text, nxt, sep):
                    text, end = _extend(lines, i + k, cand, nxt, found, len(head))
                    return text, end - i + 1
        text = text + nxt
    return None


def _better(found: list, base: list, text: str, nxt: str, sep: str) -> bool:
    """Does the joined text read an event the line alone does not (a new kind, more fields), or the same
    event with a token the wrap cut in two (`mil` + `liseconds`)?"""
    if [k for k, _ in found] != [k for k, _ in base]:
        return True
    if sum(n for _, n in found) > sum(n for _, n in base):
        return True
    if sep:
        return False
    # the same event, with a token the wrap cut in two (`mil` + `liseconds`), or cut just before a space
    return _mid_token(text, nxt) or (nxt[:1] == " " and nxt[1:2] != " ")


def _extend(lines: Sequence[str], last: int, text: str, piece: str, found: list, width: int) -> tuple[str, int]:
    """Keep joining while the last piece was a full-width one and the event stays the same event:
    (text, index of the last line used)."""
    used = last
    while used + 1 < len(lines) and used - last < MAX_JOIN and len(piece) >= max(MIN_WRAPPED, 0.8 * width):
        if not is_continuation(lines[used + 1]):
            break
        nxt = clean(lines[used + 1].rstrip("\r\n"))
        cand = text + nxt
        if [kind for kind, _ in _alone(cand)] != [kind for kind, _ in found]:
            break
        text, piece, used = cand, nxt, used + 1
    return text, used


def iter_rejoined(
    lines: Sequence[str], *, source: str | None = None, start_line: int = 1, year: int | None = None
) -> Iterator[Event]:
    """Events of a (pasted) log, with wrapped lines re-joined (see the module docstring)."""
    parser = LogParser(source, year=year)
    i = 0
    n = len(lines)
    while i < n:
        joined = _join(lines, i) if i + 1 < n else None
        if joined is not None:
            text, used = joined
            yield from parser.feed(text, start_line + i)
            i += used
            continue
        line = lines[i]
        if "\x1b" in line:
            line = _ANSI.sub("", line)
        yield from parser.feed(line, start_line + i)
        i += 1
    yield from parser.close()
