"""Each certificate rule, and an attempt to break it. Removing a rule makes its test fail."""

from __future__ import annotations

from dataclasses import replace

from gpuguard.generation.certificate import check
from gpuguard.generation.keys import sign
from gpuguard.generation.records import Frontier, Member
from tests.support.generation import KEY, OTHER_KEY, child, genesis, incarnation, members


def resign(cert, key=KEY):
    cert = replace(cert, signature="")
    return cert.with_signature(sign(key, cert.signing_bytes()))


def rules_of(violations):
    return {v.rule for v in violations}


def test_a_valid_chain_passes_every_rule():
    g0 = genesis()
    g1 = child(g0, members(4))
    assert check(g0, parent=None, key=KEY) == []
    assert check(g1, parent=g0, key=KEY) == []


def test_signature_rule_rejects_another_key_and_tampering():
    g0 = genesis()
    forged = child(g0, members(2), key=OTHER_KEY)
    assert rules_of(check(forged, parent=g0, key=KEY)) == {"signature"}
    tampered = replace(child(g0, members(2)), reason="operator")
    assert rules_of(check(tampered, parent=g0, key=KEY)) == {"signature"}


def test_duplicated_rank_is_refused_naming_the_rank():
    g0 = genesis()
    m = members(3)
    dup = resign(replace(child(g0, m), members=(*m, Member(1, incarnation(pid=7))), admitted=(0, 1, 2)))
    v = [x for x in check(dup, parent=g0, key=KEY) if x.rule == "unique-ranks"]
    assert v and v[0].member == 1


def test_duplicated_incarnation_is_refused():
    g0 = genesis()
    inc = incarnation()
    cert = child(g0, (Member(0, inc), Member(1, inc)))
    v = check(cert, parent=g0, key=KEY)
    assert rules_of(v) == {"unique-incarnations"} and {x.member for x in v} == {0, 1}


def test_chain_continuity_parent_digest_and_generation_number():
    g0 = genesis()
    g1 = child(g0, members(2))
    other_root = genesis(job_id="job")  # same job, different genesis bytes (time differs)
    other_root = resign(replace(other_root, reason="another genesis"))
    assert "chain-continuity" in rules_of(check(g1, parent=other_root, key=KEY))
    skip = resign(replace(g1, generation=2))
    assert "chain-continuity" in rules_of(check(skip, parent=g0, key=KEY))
    orphan = resign(replace(g1, parent_generation=None, parent_certificate_digest=""))
    assert "chain-continuity" in rules_of(check(orphan, parent=None, key=KEY))


def test_frontier_cannot_pass_the_last_step_committed_by_all():
    g0 = genesis()
    g1 = child(g0, members(2))
    g2 = child(g1, g1.members, step=120)
    assert rules_of(check(g2, parent=g1, key=KEY, committed_by_all=100)) == {"frontier-committed"}
    assert check(g2, parent=g1, key=KEY, committed_by_all=120) == []
    # no commit records: the frontier cannot move past the parent's own frontier
    assert rules_of(check(g2, parent=g1, key=KEY, committed_by_all=None)) == {"frontier-committed"}


def test_frontier_state_must_be_complete_and_verified():
    g0 = genesis()
    g1 = child(g0, members(2), digest="ab" * 32)
    assert rules_of(check(g1, parent=g0, key=KEY, manifest_ok=False)) == {"frontier-state"}
    assert check(g1, parent=g0, key=KEY, manifest_ok=True) == []


def test_unknown_quiescence_refused_unless_forced_and_forced_says_so():
    g0 = genesis()
    unknown = child(g0, members(2), quiescence="unknown")
    assert rules_of(check(unknown, parent=g0, key=KEY)) == {"quiescence"}
    forced = child(g0, members(2), quiescence="unknown", forced=True)
    assert check(forced, parent=g0, key=KEY) == []
    assert b'"forced":true' in forced.canonical()
    unforced = resign(replace(forced, forced=False))  # dropping the flag later is a new, refused cert
    assert rules_of(check(unforced, parent=g0, key=KEY)) == {"quiescence"}
    bogus = child(g0, members(2), quiescence="probably")
    assert rules_of(check(bogus, parent=g0, key=KEY)) == {"quiescence"}


def test_reused_rank_with_new_incarnation_is_a_new_member():
    g0 = genesis()
    g1 = child(g0, members(3))
    restarted = Member(1, incarnation(pid=9999))
    g2 = child(g1, (g1.members[0], restarted, g1.members[2]))
    assert g2.admitted == (1,)  # issue() admits it explicitly
    assert check(g2, parent=g1, key=KEY) == []
    silent = resign(replace(g2, admitted=()))  # the new process passed off as the old rank 1
    v = check(silent, parent=g1, key=KEY)
    assert rules_of(v) == {"members-admitted"} and v[0].member == 1


def test_forged_member_claiming_an_old_incarnation_id():
    g0 = genesis()
    g1 = child(g0, members(2))
    old = g1.members[1].incarnation
    forged = Member(1, replace(old, host="evil-host", pid=31337))
    g2 = resign(replace(child(g1, (g1.members[0], forged)), admitted=()))
    v = check(g2, parent=g1, key=KEY)
    assert "members-admitted" in rules_of(v) and all(x.member == 1 for x in v)
    assert any("forged" in x.message for x in v)


def test_frontier_records_collective_sequence():
    g1 = child(genesis(), members(2), step=0)
    assert isinstance(g1.frontier, Frontier) and g1.frontier.collective_seq == {"default": 0}


# ---------------------------------------------------------------------- quiescence proofs
def _with_proofs(proofs):
    from gpuguard.generation.certificate import check_stored, issue
    from gpuguard.generation.records import Frontier, Member
    from tests.support.generation import KEY, started

    parent = started(["h1", "h2"])
    child = issue(
        parent=parent,
        job_id=parent.job_id,
        members=[Member(0, parent.members[0].incarnation)],
        reason="rank-failure",
        frontier=Frontier(0),
        quiescence="proved",
        issued_by="test",
        key=KEY,
        extra={"quiescence_by": proofs(parent)},
    )
    return check_stored(child, parent=parent, key=KEY)


def test_a_lease_that_expired_proves_a_remote_member_quiet():
    ids = lambda p: [m.incarnation.id for m in p.members]  # noqa: E731
    ok = _with_proofs(lambda p: dict(zip(ids(p), ["reported, left its group", "lease expired, self-fenced"])))
    assert ok == []


def test_a_member_without_an_accepted_proof_is_refused():
    ids = lambda p: [m.incarnation.id for m in p.members]  # noqa: E731
    missing = _with_proofs(lambda p: {ids(p)[0]: "reported, left its group"})
    assert [v.rule for v in missing] == ["quiescence"] and missing[0].member == 1
    unknown = _with_proofs(lambda p: dict(zip(ids(p), ["reported, left its group", "unknown"])))
    assert "is not a proof" in unknown[0].message
