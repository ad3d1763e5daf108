"""When a log line happened: the timestamp prefixes kernel, syslog, journal, glog and Python logs put in front.

Why separate from the parsers: every log family shares the same handful of prefixes, and the node
verdict's `--since` window needs an absolute time while dmesg only gives seconds since boot. So a
line yields two things: `timestamp` (epoch seconds, when the prefix is absolute) and `uptime_s`
(dmesg's monotonic `[ 123.456]`).

Forms: ISO-8601 / journalctl short-iso / Python logging (`2024-05-08 08:47:31,877`, `...T...Z`),
`dmesg -T` (`[Fri Aug 30 11:11:22 2024]`), syslog (`Nov 29 08:22:38 host kernel:`), glog/c10
(`E0801 13:23:20.000000`, `[E321 02:07:08.408271257`), dmesg monotonic (`[ 1843.308145]`) and epoch
seconds in brackets (`[1668693503.473099]`, UCX). Times without a zone are local time (what the host
printed); forms without a year take `year` (default: the current year, or the previous one when that
would put the line more than a day in the future).
"""

from __future__ import annotations

import calendar
import time
from datetime import datetime, timedelta, timezone

from gpuguard.collectors.logrule import lazy_re

_MONTHS = {
    m: i
    for i, m in enumerate(("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"), start=1)
}
_MON = r"(?P<mon>Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"

_ISO = lazy_re(
    r"(?<!\d)(?P<y>\d{4})-(?P<m>\d{2})-(?P<d>\d{2})[T ](?P<H>\d{2}):(?P<M>\d{2}):(?P<S>\d{2})"
    r"(?:[.,](?P<f>\d{1,9}))?(?P<tz>Z|[+-]\d{2}:?\d{2})?"
)
_CTIME = lazy_re(
    r"\[(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun) "
    + _MON
    + r" +(?P<d>\d{1,2}) (?P<H>\d{2}):(?P<M>\d{2}):(?P<S>\d{2}) (?P<y>\d{4})\]"
)
_SYSLOG = lazy_re(r"^\s*" + _MON + r" +(?P<d>\d{1,2}) (?P<H>\d{2}):(?P<M>\d{2}):(?P<S>\d{2})\b")
_GLOG = lazy_re(r"(?:^|[\s\[:])[EWIF](?P<md>\d{3,4}) (?P<H>\d{2}):(?P<M>\d{2}):(?P<S>\d{2})\.(?P<f>\d+)")
_BRACKET_SECONDS = lazy_re(r"\[\s*(?P<s>\d+\.\d+)\]")
_DMESG_START = lazy_re(r"\s*\[\s*(?P<s>\d+\.\d+)\]")  # the common case, tried first (anchored: cheap)

_HEAD = 160  # prefixes live at the start; never scan a megabyte line for them
_EPOCH_MIN = 3e8  # a bracketed number above this is epoch seconds, not uptime (~9.5 years)


def _local(y: int, mo: int, d: int, h: int, mi: int, s: int, frac: str | None) -> float | None:
    try:
        ts = time.mktime((y, mo, d, h, mi, s, 0, 0, -1))
    except (OverflowError, ValueError):
        return None
    return ts + (float("0." + frac) if frac else 0.0)


def _year_for(mo: int, d: int, h: int, mi: int, s: int, year: int | None) -> tuple[int, bool]:
    if year is not None:
        return year, True
    now = time.time()
    y = time.localtime(now).tm_year
    ts = _local(y, mo, d, h, mi, s, None)
    if ts is not None and ts > now + 86400:
        return y - 1, False
    return y, False


def _valid(mo: int, d: int, h: int, mi: int, s: int) -> bool:
    return 1 <= mo <= 12 and 1 <= d <= 31 and h < 24 and mi < 60 and s < 61


def line_time(text: str, year: int | None = None) -> tuple[float | None, float | None]:
    """(timestamp, uptime_s) of a line; either may be None."""
    head = text[:_HEAD]
    m = _DMESG_START.match(head)
    if m is not None:  # raw dmesg: nothing absolute precedes the monotonic clock
        value = float(m["s"])
        return (value, None) if value >= _EPOCH_MIN else (None, value)
    timestamp: float | None = None
    uptime: float | None = None
    m = _ISO.search(head)
    if m is not None and _valid(int(m["m"]), int(m["d"]), int(m["H"]), int(m["M"]), int(m["S"])):
        frac = m["f"]
        tz = m["tz"]
        if tz:
            try:
                dt = datetime(int(m["y"]), int(m["m"]), int(m["d"]), int(m["H"]), int(m["M"]), min(int(m["S"]), 59))
            except ValueError:
                dt = None
            if dt is not None:
                offset = timedelta(0)
                if tz != "Z":
                    sign = -1 if tz[0] == "-" else 1
                    digits = tz[1:].replace(":", "")
                    offset = sign * timedelta(hours=int(digits[:2]), minutes=int(digits[2:]))
                timestamp = dt.replace(tzinfo=timezone(offset)).timestamp() + (float("0." + frac) if frac else 0.0)
        else:
            timestamp = _local(int(m["y"]), int(m["m"]), int(m["d"]), int(m["H"]), int(m["M"]), int(m["S"]), frac)
    if timestamp is None:
        m = _CTIME.search(head)
        if m is not None and _valid(_MONTHS[m["mon"]], int(m["d"]), int(m["H"]), int(m["M"]), int(m["S"])):
            timestamp = _local(int(m["y"]), _MONTHS[m["mon"]], int(m["d"]), int(m["H"]), int(m["M"]), int(m["S"]), None)
    if timestamp is None:
        m = _SYSLOG.search(head)
        if m is not None:
            mo, d, h, mi, s = _MONTHS[m["mon"]], int(m["d"]), int(m["H"]), int(m["M"]), int(m["S"])
            if _valid(mo, d, h, mi, s):
                y, _ = _year_for(mo, d, h, mi, s, year)
                timestamp = _local(y, mo, d, h, mi, s, None)
    if timestamp is None:
        m = _GLOG.search(head)
        if m is not None:
            md = m["md"]
            mo, d, h, mi, s = int(md[:-2]), int(md[-2:]), int(m["H"]), int(m["M"]), int(m["S"])
            if _valid(mo, d, h, mi, s):
                y, _ = _year_for(mo, d, h, mi, s, year)
                timestamp = _local(y, mo, d, h, mi, s, m["f"][:6])
    m = _BRACKET_SECONDS.search(head)
    if m is not None:
        value = float(m["s"])
        if value >= _EPOCH_MIN:
            if timestamp is None:
                timestamp = value
        else:
            uptime = value
    return timestamp, uptime


def utc(y: int, mo: int, d: int, h: int = 0, mi: int = 0, s: int = 0) -> float:
    """Epoch seconds of a UTC wall time (tests and callers that know the zone)."""
    return float(calendar.timegm((y, mo, d, h, mi, s, 0, 0, 0)))
