"""recovery.runtime.admission: the one check both paths run before a member follows a certificate."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gpuguard.generation.ledger_open import open_ledger
from gpuguard.generation.records import Member
from gpuguard.recovery.runtime.admission import admitted_certificate
from gpuguard.recovery.runtime.refusals import ActivationRefused
from tests.support.cli import REPO
from tests.support.generation import KEY, OTHER_KEY, child, genesis, incarnation


@pytest.fixture
def ledger_with_g1(tmp_path: Path):
    """A directory ledger holding genesis and generation 1 of two members, signed with KEY."""
    ledger = open_ledger(tmp_path)
    ledger.key = KEY
    g0 = genesis()
    ledger.activate(g0)
    mem = (Member(0, incarnation(pid=10)), Member(1, incarnation(pid=11)))
    g1 = child(g0, mem)
    ledger.activate(g1)
    return ledger, g1


def test_a_member_of_the_certificate_is_admitted_on_its_rank(ledger_with_g1):
    ledger, g1 = ledger_with_g1
    inc = g1.members[1].incarnation.id
    assert admitted_certificate(ledger, 1, incarnation_id=inc, rank=1, digest=g1.digest()) == g1
    assert admitted_certificate(ledger, 1, incarnation_id=inc) == g1  # in place: on any rank


def test_no_signing_key_refuses_on_both_paths(ledger_with_g1):
    """The in-place join once skipped this check: without the key nothing can be verified."""
    ledger, g1 = ledger_with_g1
    ledger.key = None
    inc = g1.members[0].incarnation.id
    for rank in (0, None):  # the restart path passes the rank, the in-place join does not
        with pytest.raises(ActivationRefused, match="no signing key"):
            admitted_certificate(ledger, 1, incarnation_id=inc, rank=rank)


def test_a_certificate_signed_with_another_key_is_refused(ledger_with_g1):
    ledger, g1 = ledger_with_g1
    ledger.key = OTHER_KEY
    with pytest.raises(ActivationRefused, match="fails rule signature"):
        admitted_certificate(ledger, 1, incarnation_id=g1.members[0].incarnation.id)


def test_another_incarnation_another_rank_or_another_digest_is_refused(ledger_with_g1):
    ledger, g1 = ledger_with_g1
    with pytest.raises(ActivationRefused, match="does not admit this incarnation"):
        admitted_certificate(ledger, 1, incarnation_id="someone-else")
    with pytest.raises(ActivationRefused, match="on rank 0"):
        admitted_certificate(ledger, 1, incarnation_id=g1.members[1].incarnation.id, rank=0)
    with pytest.raises(ActivationRefused, match="not the certificate the coordinator issued"):
        admitted_certificate(ledger, 1, incarnation_id=g1.members[0].incarnation.id, digest="0" * 64)


def _calls(path: Path, name: str) -> list[int]:
    tree = ast.parse(path.read_text())
    return [
        n.lineno
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and (getattr(n.func, "id", None) == name or getattr(n.func, "attr", None) == name)
    ]


def test_the_runtime_verifies_certificates_in_one_place_only():
    """Both paths (restart activation, in-place join) go through `admitted_certificate`: no other
    module of the runtime checks a stored certificate by itself (a second copy is how one path
    once lost the key check)."""
    runtime = REPO / "recovery" / "runtime"
    elsewhere = {
        p.name: _calls(p, "check_stored") + _calls(p, "check_header")
        for p in runtime.glob("*.py")
        if p.name != "admission.py"
    }
    assert {k: v for k, v in elsewhere.items() if v} == {}
    assert _calls(runtime / "runtime.py", "admitted_certificate")
    assert _calls(runtime / "inplace.py", "admitted_certificate")


def test_the_in_place_runtime_touches_no_private_member_of_the_runtime():
    """Every `self._name` the in-place runtime uses is its own (assigned or defined in inplace.py):
    it composes the runtime's public parts instead of reaching into them."""
    tree = ast.parse((REPO / "recovery" / "runtime" / "inplace.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "InPlaceRuntime")
    own = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    for node in ast.walk(cls):
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        own.add(sub.attr)
    used = {
        n.attr
        for n in ast.walk(cls)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "self"
        and n.attr.startswith("_")
        and not n.attr.startswith("__")
    }
    assert used - own == set()


def test_a_rank_of_a_large_job_is_admitted_reading_one_member_chunk(tmp_path: Path):
    """At 100,000 members every rank admits itself at once: each must read one chunk of the member
    table, not the table (which would be ranks x table bytes for the ledger to serve)."""
    ledger = open_ledger(tmp_path)
    ledger.key = KEY
    g0 = genesis()
    ledger.activate(g0)
    table = tuple(Member(r, incarnation(pid=1000 + r)) for r in range(20_000))
    g1 = child(g0, table)
    ledger.activate(g1)
    ledger = open_ledger(tmp_path)  # what a rank opens: nothing of the table in memory
    ledger.key = KEY
    reads: list[str] = []
    original = ledger._read_chunk

    def counting(sha256: str) -> bytes | None:
        reads.append(sha256)
        return original(sha256)

    ledger._read_chunk = counting  # type: ignore[method-assign]
    assert len(g1.member_table.refs) > 4
    cert = admitted_certificate(ledger, 1, incarnation_id=table[12_345].incarnation.id, rank=12_345)
    member_chunks = {r.sha256 for r in cert.member_table.refs}
    assert len([sha for sha in reads if sha in member_chunks]) == 1
    reads.clear()
    with pytest.raises(ActivationRefused, match="on rank 7"):
        admitted_certificate(ledger, 1, incarnation_id=table[12_345].incarnation.id, rank=7)
