"""Which host a log's lines came from: the syslog / journal host field, NCCL's `host:pid:tid` prefix,
torchrun's failure summary (`host : <name>`).

Why: a replayed log is judged on another machine, and its verdict must name the node the lines came
from, not the machine that read them ("host unknown" when the lines do not say). Pure: events in,
names out.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from gpuguard.foundation.events import Event

_MONTHS = frozenset(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"))
_HOST_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
_NOT_HOSTS = frozenset({"kernel", "localhost", "-", "(none)"})
MAX_NAMED = 3  # hosts named in a sentence; more are counted


def _is_clock(token: str) -> bool:
    return len(token) == 8 and token[2] == ":" and token[5] == ":" and token.replace(":", "").isdigit()


def syslog_host(text: str) -> str | None:
    """The host field of a syslog or journal line: `Nov 29 08:22:38 gpu-node-17 kernel: ...` (journalctl
    short), `2024-11-29T08:22:38+0000 gpu-node-17 kernel: ...` (short-iso), a raw `<4>` priority first.
    None when the line has no host field (`journalctl --no-hostname`, dmesg). Plain string tests, no
    regex: it runs on every event of a replay."""
    text = text.lstrip()
    if text.startswith("<") and 0 < text.find(">") <= 4:  # a raw syslog priority, `<4>`
        text = text[text.find(">") + 1 :]
    tokens = text.split(None, 5)
    if len(tokens) >= 5 and tokens[0] in _MONTHS and tokens[1].isdigit() and _is_clock(tokens[2]):
        host, tag = tokens[3], tokens[4]
    elif len(tokens) >= 3 and len(tokens[0]) >= 19 and tokens[0][4] == "-" and tokens[0][10] == "T":
        host, tag = tokens[1], tokens[2]
    else:
        return None
    if not tag.endswith(":") or not host[:1].isalnum() or len(host) > 63 or not set(host) <= _HOST_CHARS:
        return None
    return host


def line_host(event: Event) -> str | None:
    """The host one event's line names, if any."""
    host = event.fields.get("host") if isinstance(event.fields, dict) else None
    if not host:
        host = syslog_host(event.text or "")
    if not isinstance(host, str) or host.lower() in _NOT_HOSTS:
        return None
    return host


def hosts(events: Iterable[Event]) -> list[str]:
    """The hosts the lines name, most often named first."""
    counts = Counter(h for h in map(line_host, events) if h is not None)
    return [h for h, _ in counts.most_common()]


def describe(names: list[str]) -> str:
    """One name, `a, b (several hosts)`, or `host unknown`."""
    if not names:
        return "host unknown"
    if len(names) == 1:
        return names[0]
    shown = ", ".join(names[:MAX_NAMED]) + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "")
    return f"{shown} (several hosts)"
