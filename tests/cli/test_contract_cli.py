"""`gpu-doctor contract` end to end on dumps from REAL 4-rank torchrun/gloo jobs: the size
mismatch, the skipped collective and the clean run, from Flight Recorder pickles, Flight Recorder
JSON and gpuguard's own traces; and every kind of bad input."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import pytest

from tests.support import contract_job as jh

SOURCES = ("fr_pickle", "fr_json", "gg", "gg_ring")  # gg_ring: CollectiveTrace's mmap ring, no snapshots
# Flight Recorder names process groups by creation order (the job makes 1-4 up front); gpuguard's
# own trace uses the runtime's names.
PG = {
    ("clean", "fr"): ("1", "2"),
    ("skip", "fr"): ("3",),
    ("size", "fr"): ("4",),
    ("clean", "gg"): ("default", "pair"),
    ("skip", "gg"): ("default",),
    ("size", "gg"): ("default",),
}


def _pg(scenario: str, source: str, i: int = 0) -> str:
    return PG[(scenario, "gg" if source.startswith("gg") else "fr")][i]


@pytest.fixture(scope="module")
def dumps():
    return jh.real_dumps()


def _json(cli, *args):
    res = cli("gpu-doctor", "contract", *map(str, args), "--json")
    assert res.stderr == "" or "warning" not in res.stderr
    return res, (json.loads(res.stdout) if res.stdout.strip() else None)


@pytest.mark.parametrize("source", SOURCES)
def test_size_mismatch_names_seq_rank_and_field(cli, dumps, source):
    res, doc = _json(cli, dumps["size"] / source)
    assert res.returncode == 1, res.stderr
    assert doc["schema"] == "gpuguard.contract/1" and doc["holds"] is False and doc["partial"] is False
    d = doc["first_divergence"]
    assert (d["pg"], d["seq"], d["kind"], d["field"], d["ranks"]) == (
        _pg("size", source),
        6,
        "size_mismatch",
        "count",
        [3],
    )
    assert d["pg_desc"] == ("" if source.startswith("gg") else "size")
    assert d["expected"]["count"] == 1024 and d["actual"]["count"] == 512
    assert d["majority_ranks"] == [0, 1, 2]


@pytest.mark.parametrize("source", SOURCES)
def test_skipped_collective_is_the_hang_and_the_earlier_cause_is_named(cli, dumps, source):
    res, doc = _json(cli, dumps["skip"] / source)
    assert res.returncode == 1, res.stderr
    d = doc["first_divergence"]
    assert (d["pg"], d["seq"], d["kind"], d["ranks"], d["missing_ranks"]) == (
        _pg("skip", source),
        8,
        "missing_participant",
        [2],
        [2],
    )
    assert d["actual"] is None and d["expected"]["op"] == "all_reduce"
    hints = " ".join(d["hints"])
    if source == "fr_json":  # no frames in JSON dumps: only the generic later-call explanation
        assert "later call" in hints
    else:  # call sites show rank 2 one call ahead from #5, where it skipped sync_metrics
        assert "ahead" in hints and "#5" in hints and "later call #8" in hints
        assert ("sync_metrics" if source == "fr_pickle" else "contract_job.py:") in hints
    if source == "gg_ring":  # read from the mmap rings the ranks left behind, not from any dump call
        assert {i["format"] for i in doc["inputs"]} == {"gpuguard-ring"}


@pytest.mark.parametrize("source", SOURCES)
def test_clean_job_holds(cli, dumps, source):
    res, doc = _json(cli, dumps["clean"] / source)
    assert res.returncode == 0, res.stderr
    assert doc["holds"] is True and doc["first_divergence"] is None
    assert {t["pg"] for t in doc["timelines"]} == set(PG[("clean", "gg" if source.startswith("gg") else "fr")])
    assert all(t["sequences_checked"] > 0 for t in doc["timelines"])
    human = cli("gpu-doctor", "contract", str(dumps["clean"] / source))
    assert human.returncode == 0 and "contract holds" in human.stdout and "no divergence" in human.stdout


def test_human_output_shows_verdict_table_and_call_sites(cli, dumps):
    res = cli("gpu-doctor", "contract", str(dumps["skip"] / "fr_pickle"))
    assert res.returncode == 1
    out = res.stdout
    assert "contract BROKEN" in out and "seq #8" in out and "missing_participant" in out
    assert "majority: rank(s) 0-1,3" in out and "culprit: rank(s) 2" in out
    assert "> 8" in out and "hint:" in out and "sync_metrics" in out


def test_whole_buffers_show_every_process_group_and_pg_filter(cli, dumps):
    """The unfiltered Flight Recorder buffers hold all five groups: two broken, three holding."""
    res, doc = _json(cli, dumps["all"] / "fr_pickle")
    assert res.returncode == 1
    assert [(t["pg"], t["holds"]) for t in doc["timelines"]][:2] == [("3", False), ("4", False)]
    assert {t["pg"] for t in doc["timelines"] if t["holds"]} == {"0", "1", "2"}
    assert (doc["first_divergence"]["pg"], doc["first_divergence"]["kind"]) == ("3", "missing_participant")
    res, doc = _json(cli, dumps["all"] / "fr_pickle", "--pg", "size")
    assert res.returncode == 1 and [t["pg"] for t in doc["timelines"]] == ["4"]
    assert doc["first_divergence"]["seq"] == 6
    res, doc = _json(cli, dumps["all"] / "fr_pickle", "--pg", "clean_pair")
    assert res.returncode == 0 and [t["pg"] for t in doc["timelines"]] == ["2"]
    res, doc = _json(cli, dumps["skip"] / "gg", "--pg", "default")
    assert res.returncode == 1 and doc["first_divergence"]["seq"] == 8
    bad = cli("gpu-doctor", "contract", str(dumps["skip"] / "gg"), "--pg", "nope")
    assert bad.returncode == 64 and "no such process group" in bad.stderr and "Traceback" not in bad.stderr


def test_missing_rank_dump_is_partial(cli, dumps, tmp_path):
    for r in (0, 1, 3):
        shutil.copy(dumps["size"] / "fr_pickle" / f"rank_{r}", tmp_path / f"rank_{r}")
    res, doc = _json(cli, tmp_path)
    assert res.returncode == 1
    assert doc["partial"] is True and any("rank(s) 2" in w for w in doc["warnings"])
    d = doc["first_divergence"]
    assert (d["seq"], d["kind"], d["ranks"]) == (6, "size_mismatch", [3])
    human = cli("gpu-doctor", "contract", str(tmp_path))
    assert "PARTIAL" in human.stdout


def test_two_dumps_for_one_rank_is_partial(cli, dumps):
    """No divergence but a partial result is "unknown" (3), never "holds" (0)."""
    res, doc = _json(cli, dumps["clean"] / "fr_pickle", dumps["clean"] / "fr_json" / "rank_0.json")
    assert res.returncode == 3
    assert doc["partial"] is True and any("rank 0: two dumps" in w for w in doc["warnings"])
    assert doc["holds"] is True  # the document still says what was found


def test_missing_dumps_without_divergence_exit_3_not_holds(cli, dumps, tmp_path):
    for r in (0, 1, 2):
        shutil.copy(dumps["clean"] / "fr_pickle" / f"rank_{r}", tmp_path / f"rank_{r}")
    human = cli("gpu-doctor", "contract", str(tmp_path), "--world-size", "4")
    assert human.returncode == 3, human.stdout + human.stderr
    assert "contract UNKNOWN" in human.stdout and "contract holds" not in human.stdout
    res, doc = _json(cli, tmp_path, "--world-size", "4")
    assert res.returncode == 3 and doc["partial"] is True


def test_control_characters_in_dump_fields_are_escaped(cli, dumps, tmp_path):
    """A dump is input from the job: its strings (op names, call sites) must not drive the terminal."""
    payload = "\x1b]0;owned\x07\x1b[2J"
    for f in (dumps["size"] / "gg").iterdir():
        doc = json.loads(f.read_text())
        for e in doc["entries"]:
            e["op"] += payload
            e["call_site"] = (e.get("call_site") or "train.py:1") + payload
        (tmp_path / f.name).write_text(json.dumps(doc))
    human = cli("gpu-doctor", "contract", str(tmp_path))
    assert human.returncode == 1, human.stderr
    assert "\x1b" not in human.stdout and "\x07" not in human.stdout
    assert "\\x1b]0;owned\\x07" in human.stdout


def test_generations_never_mix(cli, dumps, tmp_path):
    """Rank 3's trace from generation 1 is a separate timeline: its 512-element call is no mismatch."""
    for r in range(4):
        doc = json.loads((dumps["size"] / "gg" / f"rank_{r}.json").read_text())
        if r == 3:
            doc["generation"] = 1
        (tmp_path / f"rank_{r}.json").write_text(json.dumps(doc))
    res, out = _json(cli, tmp_path)
    assert res.returncode == 0, out
    assert out["holds"] is True and any("generation" in w for w in out["warnings"])
    assert sorted((t["generation"], tuple(t["ranks"])) for t in out["timelines"]) == [(0, (0, 1, 2)), (1, (3,))]


def test_bad_inputs_exit_with_documented_codes(cli, dumps, tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    evil = tmp_path / "evil"
    evil.mkdir()
    shutil.copy(dumps["clean"] / "fr_pickle" / "rank_0", evil / "rank_0")
    (evil / "rank_1").write_bytes(pickle.dumps({"version": "2.10", "entries": [Evil()]}, protocol=2))
    res = cli("gpu-doctor", "contract", str(evil))
    # the unsafe file is refused in one line; rank 0's dump is still analysed: partial, exit 3
    assert res.returncode == 3 and "unsafe pickle refused" in res.stderr and ".system" in res.stderr
    assert res.stderr.count("\n") == 1 and "rank_1" in res.stderr and not marker.exists()
    assert "contract UNKNOWN" in res.stdout and "Traceback" not in res.stderr
    res = cli("gpu-doctor", "contract", str(evil / "rank_1"))  # nothing else to analyse: 65
    assert res.returncode == 65 and "unsafe pickle refused" in res.stderr and res.stderr.count("\n") == 1

    trunc = tmp_path / "rank_2"
    trunc.write_bytes((dumps["clean"] / "fr_pickle" / "rank_2").read_bytes()[:-40])
    res = cli("gpu-doctor", "contract", str(trunc))
    assert res.returncode == 65 and "truncated" in res.stderr

    shape = tmp_path / "rank_5.json"
    shape.write_text(json.dumps({"version": "2.10", "entries": {"not": "a list"}}))
    res = cli("gpu-doctor", "contract", str(shape), "--json")
    assert res.returncode == 65 and "'entries' is not a list" in res.stderr and res.stdout == ""

    res = cli("gpu-doctor", "contract", str(tmp_path / "absent"))
    assert res.returncode == 66 and "no such file" in res.stderr

    res = cli("gpu-doctor", "contract")
    assert res.returncode == 64
