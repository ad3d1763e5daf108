"""Evidence beyond the Xid, read from real line formats (tests/data/node-evidence, sources in its README):
GSP timeouts and memory-subsystem errors by GPU index, the NIC's registration errors, device-side
assertions, NCCL warnings with advice (or the plain statement that none is known)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuguard.collectors import kernel_log, logscan
from gpuguard.collectors.logparse import parse_line

DATA = Path(__file__).resolve().parents[1] / "data" / "node-evidence"


def _events(name: str, kind: str | None = None):
    events = list(kernel_log.read_file(DATA / name).events)
    return [e for e in events if kind is None or e.kind == kind]


def test_gsp_lines_name_the_gpu_by_index_without_an_xid():
    events = _events("gsp-gh100.log")
    assert [(e.line, e.fields["fault"], e.fields["gpu_index"]) for e in events] == [
        (2, "gsp_timeout", 6),
        (3, "gsp_timeout", 6),
        (7, "memsys_error", 6),
        (9, "gsp_timeout", 6),
    ]
    assert all(e.kind == "gpu_fault" and e.severity == "critical" for e in events)
    assert not [e for e in events if e.kind == "xid"]


def test_gsp_heartbeat_in_a_journal_without_host():
    events = _events("gsp-heartbeat-journal.log")
    assert [(e.line, e.fields["fault"], e.fields["gpu_index"]) for e in events] == [
        (3, "gsp_timeout", 0),
        (4, "gsp_timeout", 0),
    ]  # the nvAssertFailedNoLog and RPC-event lines are not evidence


def test_the_nics_registration_errors_are_job_level_network_evidence():
    events = _events("mlx5-reg-mr.log")
    assert [(e.kind, e.fields["device"], e.fields["errno"]) for e in events] == [("nic_error", "mlx5_0", "ENOMEM")] * 3
    assert "ulimit -l" in events[0].diagnosis and "not a GPU fault" in events[0].diagnosis
    (cmd,) = _events("mlx5-cmd-check.log")
    assert (cmd.kind, cmd.fields["function"], cmd.fields["mlx5_status"]) == ("nic_error", "mlx5_cmd_check", 3)


def test_a_device_side_assertion_is_the_applications_not_the_gpus():
    events, _ = logscan.read_log(DATA / "cuda-assert.log")
    kinds = {e.kind: e for e in events}
    assert set(kinds) == {"cuda_error", "cuda_assert"}
    a = kinds["cuda_assert"]
    assert (a.fields["kernel"], a.fields["condition"], a.fields["source_line"]) == (
        "nll_loss_forward_reduce_cuda_kernel_2d",
        "t >= 0 && t < n_classes",
        250,
    )
    assert "not a GPU fault" in a.diagnosis and "fault" not in a.fields
    windows = r"C:\actions-runner\_work\pytorch\aten\src\ATen\native\cuda\NLLLoss2d.cu:103: block: [0,0,0], thread: [384,0,0] Assertion `t >= 0 && t < n_classes` failed."
    assert parse_line(windows, 1).fields["source_line"] == 103  # https://github.com/lorenmt/mtan/issues/62


@pytest.mark.parametrize(
    "name,advice",
    [
        ("nccl-bootstrap-duplicate-rank.log", "Two processes hold the same rank"),
        ("nccl-ib-port-error.log", "flapping link"),
    ],
)
def test_nccl_warnings_get_advice(name, advice):
    events, _ = logscan.read_log(DATA / name)
    (warn,) = [e for e in events if e.kind == "nccl_warn"]
    assert advice in warn.diagnosis


def test_an_nccl_warning_without_advice_says_so():
    e = parse_line("gpu-node-17:2817:2904 [1] misc/foo.cc:12 NCCL WARN Something new happened", 1)
    assert e.kind == "nccl_warn" and "knows no advice for this warning" in e.diagnosis


def test_a_job_log_given_as_kernel_log_yields_its_job_level_events():
    assert [e.kind for e in _events("watchdog-five-ranks.log")] == ["watchdog_timeout"] * 5


def test_a_worknccl_on_its_own_line_keeps_its_ranks_attribution():
    events, _ = logscan.read_log(DATA / "watchdog-worknccl-own-line.log")
    assert [(e.line, e.fields["rank"], e.fields["seq"]) for e in events] == [
        (1, 0, 42),
        (3, 1, 42),
        (5, 2, 42),
        (7, 3, 42),
    ]


def test_interleaved_heads_give_no_rank_rather_than_a_wrong_one(tmp_path):
    lines = (DATA / "watchdog-worknccl-own-line.log").read_text().splitlines()
    heads, works = lines[0::2], lines[1::2]
    log = tmp_path / "interleaved.log"
    log.write_text("\n".join(heads + works) + "\n")  # every head first, then every WorkNCCL line
    events, _ = logscan.read_log(log)
    assert [e.fields["rank"] for e in events] == [None] * 4
