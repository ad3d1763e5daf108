"""Rule patterns are compiled on first use (`logrule.lazy_re`, start-up time) and behave as compiled ones."""

from __future__ import annotations

import re
import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from gpuguard.collectors.logrule import LazyPattern, lazy_re

PATTERNS = [(r"Xid \(PCI:(?P<pci>[0-9a-f:.]+)\): (\d+)", 0), (r"nccl ?(warn|error)", re.I), (r"[0-9]{1,6}", re.ASCII)]


@given(text=st.text(alphabet="Xid (PCI:0a.): 13579nNcCl WwaRrNerox", max_size=60), which=st.sampled_from(PATTERNS))
def test_a_lazy_pattern_answers_as_the_compiled_one(text: str, which: tuple[str, int]) -> None:
    lazy, real = lazy_re(*which), re.compile(*which)
    for method in ("search", "match", "fullmatch"):
        got, want = getattr(lazy, method)(text), getattr(real, method)(text)
        assert (got and (got.span(), got.groups(), got.groupdict())) == (
            want and (want.span(), want.groups(), want.groupdict())
        )
    assert lazy.findall(text) == real.findall(text)
    assert [m.span() for m in lazy.finditer(text)] == [m.span() for m in real.finditer(text)]
    assert lazy.sub("_", text) == real.sub("_", text) and lazy.split(text) == real.split(text)
    assert (lazy.pattern, lazy.flags, lazy.groups) == (real.pattern, real.flags, real.groups)


def test_compiled_once_then_plain_attributes() -> None:
    lazy = LazyPattern(r"a+")
    assert "search" not in vars(lazy)
    assert lazy.search("baa").span() == (1, 3)
    assert "search" in vars(lazy) and "match" in vars(lazy)  # later calls skip __getattr__


def test_importing_the_parser_compiles_no_rule_pattern() -> None:
    probe = (
        "import gc, sys\n"
        "from gpuguard.collectors import logparse\n"
        "from gpuguard.collectors.logrule import LazyPattern\n"
        "lazy = [o for o in gc.get_objects() if isinstance(o, LazyPattern)]\n"
        "print(len(lazy), sum('search' in vars(o) for o in lazy))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True).stdout
    total, compiled = map(int, out.split())
    assert total >= 80 and compiled == 0, out
