"""One prepared device check: the NVML, NCCL and CUDA paths gpuguard was written against but had
never run on (issue 27), in one short call, every artefact under one directory, one row per step.

    python bench/gpu_check.py [--json] [--out DIR] [--dry-run-cpu] [--budget S]

Rows (`gpuguard.bench/1`; each step has its own time limit, a failed step is recorded and the
others still run):
  nvml_live      `gpu-doctor diagnose node --mode live --json --dump-nvml`: the real pynvml path (ECC,
                 retired pages, remapped rows, throttle reasons, PCIe, NVLink, recovery action); which
                 fields the driver answered, per GPU.
  nccl_contract  tests/support/jobs/fr_skip_job.py, 2 ranks on NCCL, the Flight Recorder on: an
                 all_reduce, an uneven all_to_all_single, a send/recv pair, then rank 1 skips an
                 all_reduce; rank 0 times out and PyTorch dumps every rank (TORCH_NCCL_DUMP_ON_TIMEOUT).
                 `gpu-doctor contract` on the dumps must name rank 1, with the send/recv paired.
  inplace_nccl   examples/inplace_train.py on `cpu:gloo,cuda:nccl` with CUDA tensors: rank 1 is
                 SIGKILLed before an all-reduce, rank 0 switches generation in place (same process,
                 a certified chain, the result equal to a one-process reference), and the runtime's
                 copy of the state to host memory at each commit (`remember_p50_s`) is timed on a
                 256 MB padded state.
  sharded_rng    tests/support/jobs/fsdp_job.py, 2-rank FSDP2: sharded snapshots carry each rank's RNG
                 state; a second launch restores them: `torch.cuda.get_rng_state_all()` bytes equal.
--dry-run-cpu rehearses the same steps on the CPU (the pynvml fake on the bundled sample, gloo, CPU
tensors) so that CI keeps the script working; its rows say what was simulated and that CUDA was
not exercised. Nothing in a rehearsal is a GPU result.

Two ranks on one GPU: NCCL refuses them unless each claims a host of its own
(`gpuguard.examples.devices`), so NCCL runs over its socket transport on loopback: its collectives,
send/recv, Flight Recorder and failure paths, not NVLink. Exit: 0 every row ok; 1 a row failed or
was not run; 64 --out is not an empty directory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SCHEMA  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
JOBS = REPO / "tests" / "support" / "jobs"
FAKES = REPO / "tests" / "support" / "fakes"
SAMPLE_NVML = REPO / "collectors" / "data" / "sample-nvml.json"
PY = sys.executable
LIMITS = {"nvml_live": 45.0, "nccl_contract": 120.0, "inplace_nccl": 150.0, "sharded_rng": 160.0}  # seconds per step
NVML_FIELDS = ("ecc", "retired_pages", "remapped_rows", "clock_event_reasons", "pcie", "nvlink", "recovery_action")
# The Flight Recorder on, dumping on a timeout (names as torch 2.13 reads them; the older ones too)
FR_ON = {
    "TORCH_FR_BUFFER_SIZE": "2000",
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "TORCH_NCCL_ENABLE_MONITORING": "1",  # the thread that writes the dumps
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",  # 1 (tear down) could kill a rank before every rank has dumped
    "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "10000",
    "NCCL_DEBUG": "WARN",
}
# A dead peer must surface as an exception of the collective, as it does on gloo: the in-place
# runtime's except path. Without blocking wait the all-reduce returns at once and a later host copy
# either hangs or, once the watchdog aborts the communicator, reads a result that never arrived.
NCCL_FAILURE = {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "NCCL_DEBUG": "WARN"}

FACTS = """
import json, sys
out = {"python": sys.version.split()[0], "torch": None}
try:
    import torch
    import torch.distributed as dist
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
else:
    out.update(torch=torch.__version__, torch_cuda_build=torch.version.cuda, cuda_available=torch.cuda.is_available(),
               nccl_available=bool(dist.is_available() and dist.is_nccl_available()), nccl_version=None)
    try:
        out["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        pass
    if out["cuda_available"]:
        out.update(device_count=torch.cuda.device_count(), device_name=torch.cuda.get_device_name(0),
                   capability=".".join(map(str, torch.cuda.get_device_capability(0))))
print(json.dumps(out))
"""


class Check:
    """What every step shares: the output directory, rehearsal or device run, the facts, the deadline."""

    def __init__(self, out: Path, dry: bool, facts: dict[str, Any], budget: float) -> None:
        self.out, self.dry, self.facts = out, dry, facts
        self.deadline = time.monotonic() + budget
        self.device = "cpu" if dry else "cuda"

    def dir(self, name: str) -> Path:
        d = self.out / name
        d.mkdir(mode=0o700)
        return d

    def limit(self, cap: float) -> float:
        return max(0.0, min(cap, self.deadline - time.monotonic()))

    def env(self, **extra: str) -> dict[str, str]:
        base = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore", "LOGLEVEL": "ERROR"}
        return {**os.environ, **base, **extra}

    def not_runnable(self, needs_torch: bool) -> str | None:
        """Why a step cannot run here, or None."""
        f = self.facts
        if not needs_torch:
            return None
        if not f.get("torch"):
            return f"no torch here ({f.get('torch_error', 'not importable')}): not run"
        if self.dry:
            return None
        if not f.get("cuda_available"):
            kind = "a CPU build" if not f.get("torch_cuda_build") else "a CUDA build that sees no GPU"
            return f"torch {f['torch']} is {kind}: not run (README: On a GPU)"
        if not f.get("nccl_available"):
            return f"torch {f['torch']} has no NCCL: not run"
        return None


# ---------------------------------------------------------------- processes


def run(
    argv: list[str], *, timeout: float, log: Path, stdout: Path | None = None, env: dict[str, str] | None = None
) -> int | None:
    """`argv` in a session of its own, output to files; at the timeout that session is killed: None."""
    with open(log, "ab") as err, open(stdout or os.devnull, "wb") as out:
        proc = subprocess.Popen(
            argv, stdout=out if stdout else err, stderr=err, env=env, cwd=REPO, start_new_session=True
        )
        try:
            return proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the session started above: the command and its workers
            proc.wait(timeout=10)
            return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pair(script: Path, *args: str, timeout: float, log: Path, env: dict[str, str]) -> int | None:
    """Two ranks of `script` on this host with torchrun's environment (rank 0 serves the store), not
    under torchrun: its agent would cost one more `import torch` per launch. As torchrun does, the
    first rank to fail stops the other. Returns the first nonzero exit status, 0, or None at the timeout."""
    base = {
        **env,
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    procs: list[subprocess.Popen[bytes]] = []
    end = time.monotonic() + max(1.0, timeout)
    failed: int | None = None  # the exit status of the rank that failed first, by itself
    with open(log, "ab") as out:
        try:
            for r in (0, 1):
                env_r = {**base, "RANK": str(r), "LOCAL_RANK": str(r)}
                procs.append(
                    subprocess.Popen(
                        [PY, str(script), *args],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env_r,
                        cwd=REPO,
                        start_new_session=True,
                    )
                )
            while time.monotonic() < end:
                codes = [p.poll() for p in procs]  # every rank polled, each time
                failed = next((c for c in codes if c not in (None, 0)), None)
                if failed is not None or None not in codes:
                    break
                time.sleep(0.1)
        finally:
            running = [p for p in procs if p.poll() is None]
            for p in running:
                os.killpg(p.pid, signal.SIGKILL)  # the session started above: that rank and its children
                p.wait(timeout=10)
    if failed is None and running:
        return None
    return failed if failed is not None else next((p.returncode for p in procs if p.returncode != 0), 0)


def cli(module: str, *args: str) -> list[str]:
    return [PY, "-m", f"gpuguard.cli.{module}", *args]


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def tail(path: Path, n: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def fr_paths(prefix: Path) -> dict[str, str]:
    """Where PyTorch writes Flight Recorder dumps (`<prefix><rank>`): inside the output directory."""
    prefix.parent.mkdir(mode=0o700, exist_ok=True)
    return {"TORCH_FR_DUMP_TEMP_FILE": str(prefix), "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(prefix)}


# ---------------------------------------------------------------- the steps


def check_nvml(ck: Check) -> dict[str, Any]:
    d = ck.dir("nvml")
    env = ck.env()
    row: dict[str, Any] = {"simulated": ck.dry}
    if ck.dry:  # the project's pynvml fake, at the module boundary, on the bundled 4-GPU sample
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(FAKES), env.get("PYTHONPATH"))))
        env["GPUGUARD_FAKE_NVML"] = str(SAMPLE_NVML)
        row["nvml_source"] = "fake pynvml (tests/support/fakes) on collectors/data/sample-nvml.json"
    snap_path = d / "nvml-snapshot.json"
    argv = cli("doctor", "diagnose", "node", "--mode", "live", "--json", "--dump-nvml", str(snap_path))
    rc = run(argv, timeout=ck.limit(LIMITS["nvml_live"]), log=d / "diagnose.log", stdout=d / "diagnose.json", env=env)
    row["exit_code"] = rc
    doc = read_json(d / "diagnose.json")
    if not isinstance(doc, dict):
        why = "timed out" if rc is None else f"exited {rc} without a JSON document"
        return {**row, "ok": False, "error": f"gpu-doctor diagnose node {why}: {tail(d / 'diagnose.log')}"}
    sections = doc.get("sections") or {}
    nvml, klog = sections.get("nvml") or {}, sections.get("kernel_log") or {}
    snap = read_json(snap_path) or {}
    gpus = [
        {
            **{k: g.get(k) for k in ("index", "name", "pci_bus_id", "lost", "error")},
            "fields": {f: ("read" if g.get(f) is not None else "not supported") for f in NVML_FIELDS},
            "errors": g.get("errors") or {},
        }
        for g in snap.get("gpus") or []
        if isinstance(g, dict)
    ]
    ok = doc.get("mode") == "live" and nvml.get("status") == "ok" and nvml.get("source") == "live" and bool(gpus)
    row.update(
        verdict=doc.get("verdict"),
        summary=doc.get("summary"),
        nvml_status=nvml.get("status"),
        nvml_reason=nvml.get("reason"),
        driver_version=nvml.get("driver_version"),
        kernel_log=f"{klog.get('status')}" + (f" ({klog['reason']})" if klog.get("reason") else ""),
        gpus=gpus,
        finding=f"NVML {nvml.get('status')}, {len(gpus)} GPU(s), verdict {doc.get('verdict')}",
    )
    return {**row, "ok": ok}


def check_contract(ck: Check) -> dict[str, Any]:
    d = ck.dir("contract")
    backend = "gloo" if ck.dry else "nccl"
    prefix = d / "fr" / "rank_"
    limit = ck.limit(LIMITS["nccl_contract"])
    args = ("--out", str(d), "--backend", backend, "--timeout", "3" if ck.dry else "10")
    env = ck.env(**FR_ON, **fr_paths(prefix))
    rc = pair(
        JOBS / "fr_skip_job.py",
        *args,
        "--dump-wait",
        f"{min(60.0, limit / 2):.0f}",
        timeout=limit,
        log=d / "job.log",
        env=env,
    )
    dumps = [(read_json(d / f"rank_{r}.json") or {}).get("dump", "none") for r in (0, 1)]
    row: dict[str, Any] = {"backend": backend, "device": ck.device, "cuda_exercised": not ck.dry, "job_exit": rc}
    row["dumps"] = dumps
    files = [p if p.exists() else d / "fallback" / f"rank_{r}" for r, p in ((r, Path(f"{prefix}{r}")) for r in (0, 1))]
    missing = [r for r, f in enumerate(files) if not f.exists()]
    if missing:
        return {**row, "ok": False, "error": f"no Flight Recorder dump from rank(s) {missing}: {tail(d / 'job.log')}"}
    argv = cli("doctor", "contract", *map(str, files), "--json", "--world-size", "2")
    crc = run(argv, timeout=ck.limit(60), log=d / "contract.log", stdout=d / "contract.json", env=ck.env())
    doc = read_json(d / "contract.json")
    if not isinstance(doc, dict):
        return {**row, "ok": False, "error": f"gpu-doctor contract exited {crc}: {tail(d / 'contract.log')}"}
    div = doc.get("first_divergence") or {}
    p2p = [t for t in doc.get("timelines", []) if t.get("scope") == "p2p"]
    row.update(
        contract_exit=crc,
        kind=div.get("kind"),
        culprit_ranks=div.get("ranks"),
        seq=div.get("seq"),
        ambiguous=div.get("ambiguous"),
        explanation=div.get("explanation"),
        p2p_pairs_checked=sum(t.get("sequences_checked", 0) for t in p2p),
        p2p_holds=all(t.get("holds") for t in p2p) if p2p else None,
        dump_versions=sorted({str(i.get("version")) for i in doc.get("inputs", [])}),
        warnings=doc.get("warnings", []),
    )
    named = div.get("kind") == "missing_participant" and div.get("ranks") == [1]
    row["finding"] = (
        f"culprit rank(s) {div.get('ranks')} ({div.get('kind')} at #{div.get('seq')})"
        if div
        else f"no divergence found (contract exit {crc}): rank 1's skip was not seen"
    )
    if ck.dry:
        row["p2p_checked"] = False
        row["note"] = (
            "gloo's Flight Recorder records no send/recv and gloo has no dump on timeout (the job writes the "
            "dumps): p2p pairing and the on-timeout dump are proved only on NCCL"
        )
        return {**row, "ok": named}
    row["p2p_checked"] = True
    paired = bool(p2p) and bool(row["p2p_holds"]) and row["p2p_pairs_checked"] >= 1
    row["finding"] += f"; send/recv: {row['p2p_pairs_checked']} pair(s) checked" + ("" if paired else ", NOT paired")
    return {**row, "ok": named and paired and dumps == ["on-timeout", "on-timeout"]}


def check_inplace(ck: Check) -> dict[str, Any]:
    from gpuguard.examples.inplace_train import Cluster, reference
    from gpuguard.foundation.env import BACKEND_ENV, SNAPSHOT_EVERY_ENV

    d = ck.dir("inplace")
    job, steps, victim, at = d / "job", 12, 1, 5
    pad_mb = 4.0 if ck.dry else 256.0
    backend = "gloo" if ck.dry else "cpu:gloo,cuda:nccl"
    env = {
        "OMP_NUM_THREADS": "1",
        BACKEND_ENV: backend,
        "INPLACE_DEVICE": ck.device,
        "INPLACE_PAD_MB": str(pad_mb),
        SNAPSHOT_EVERY_ENV: "0",  # the in-place path keeps its own copies in memory; no disk snapshot per commit
        "LOCAL_WORLD_SIZE": "2",
        **fr_paths(d / "fr" / "rank_"),
        **({} if ck.dry else NCCL_FAILURE),
    }
    limit = ck.limit(LIMITS["inplace_nccl"])
    faults = f"{victim}:{at}:before_allreduce:kill"
    with Cluster.launch(
        job,
        2,
        steps=steps,
        faults=faults,
        step_sleep=0.01,
        pg_timeout=5.0 if ck.dry else 10.0,
        grace=3.0,
        extra_env=env,
    ) as c:
        codes = c.wait(max(1.0, limit - 15))
        pids = {r: p.pid for r, p in c.procs.items()}
        results = c.results()
    hist = read_history(ck, job, d)
    res = results.get(0) or {}
    ref = reference(steps)
    got = res.get("params") or []
    oracle = len(got) == len(ref) and all(math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) for a, b in zip(got, ref))
    fault = read_json(job / "faults" / f"{victim}-before_allreduce-{at}.json") or {}
    phases = ((res.get("switches") or [{}])[-1]).get("phases") or {}
    resume = phases.get("first_commit", 0) - fault["time"] if "time" in fault and "first_commit" in phases else None
    p50 = res.get("remember_p50_s")
    chain = [g.get("switch") for g in hist]
    row: dict[str, Any] = {
        "backend": backend,
        "device": ck.device,
        "cuda_exercised": not ck.dry,
        "workers": 2,
        "fault": f"rank {victim} SIGKILLed before the all-reduce of step {at}",
        "exit_codes": [codes.get(0), codes.get(1)],
        "survivor_same_process": bool(res) and res.get("pid") == pids.get(0),
        "last_step": res.get("last_step"),
        "equals_reference": oracle,
        "switch_chain": chain,
        "kill_to_first_commit_s": round(resume, 3) if resume is not None else None,
        "state_mb": pad_mb,
        "copy": "host memory to host memory (CPU rehearsal)" if ck.dry else "device to host",
        "remember_p50_s": p50,
        "copy_gb_per_s": round(pad_mb * 2**20 / p50 / 1e9, 2) if p50 else None,
        "nccl_env": {} if ck.dry else NCCL_FAILURE,
    }
    ok = codes.get(victim) == -9 and codes.get(0) == 0 and res.get("last_step") == steps and oracle
    ok = ok and row["survivor_same_process"] and chain[-1:] == ["in-place"]
    row["finding"] = (
        f"switch chain {chain}, commit copy {p50 * 1e3:.1f} ms for {pad_mb:g} MB"
        if p50
        else f"exit codes {row['exit_codes']}"
    )
    if not ok:
        row["error"] = f"survivor log: {c.log(0)[-600:].strip()}"
    return {**row, "ok": ok}


def read_history(ck: Check, job: Path, d: Path) -> list[dict[str, Any]]:
    """`gpu-generation history --json`: the certified chain, oldest first."""
    argv = cli("generation", "history", "--job-dir", str(job), "--json")
    run(argv, timeout=ck.limit(60), log=d / "history.log", stdout=d / "history.json", env=ck.env())
    doc = read_json(d / "history.json")
    return list(doc.get("generations") or []) if isinstance(doc, dict) else []


def check_rng(ck: Check) -> dict[str, Any]:
    d = ck.dir("rng")
    job = d / "job"
    common = ("--steps", "4", "--device", ck.device, "--rng-check", "--max-seconds", "150")
    env = ck.env(**fr_paths(d / "fr" / "rank_"), **({} if ck.dry else {"NCCL_DEBUG": "WARN"}))
    half = ck.limit(LIMITS["sharded_rng"]) / 2
    job_py = JOBS / "fsdp_job.py"
    saved = pair(job_py, str(job), *common, "--snapshot-every", "3", timeout=half, log=d / "save.log", env=env)
    restored = pair(job_py, str(job), *common, "--resume", timeout=ck.limit(half), log=d / "restore.log", env=env)
    checks = [read_json(job / "rng" / f"check-rank-{r}.json") for r in (0, 1)]
    row: dict[str, Any] = {
        "device": ck.device,
        "backend": "gloo" if ck.dry else "cpu:gloo,cuda:nccl",
        "cuda_exercised": not ck.dry,
        "save_exit": saved,
        "restore_exit": restored,
        "ranks": checks,
    }
    if not all(isinstance(c, dict) for c in checks):
        log = d / ("save.log" if saved != 0 else "restore.log")
        return {**row, "ok": False, "error": f"no RNG check from every rank: {tail(log)}"}
    good = all(c["restored"] and c["cpu_equal"] and c["cpu_differed_before"] for c in checks)
    if ck.dry:
        row["note"] = "the CPU RNG round trip only: CUDA was not exercised"
    else:
        good = good and all(c["cuda_equal"] and c["cuda_differed_before"] and c["cuda_state_bytes"] for c in checks)
    row["finding"] = f"snapshot step {checks[0]['step']}: {checks[0]['why']}; bytes equal on both ranks: {good}"
    return {**row, "ok": good and saved == 0 and restored == 0}


STEPS: tuple[tuple[str, Callable[[Check], dict[str, Any]], bool], ...] = (
    ("nvml_live", check_nvml, False),
    ("nccl_contract", check_contract, True),
    ("inplace_nccl", check_inplace, True),
    ("sharded_rng", check_rng, True),
)


def run_step(ck: Check, name: str, fn: Callable[[Check], dict[str, Any]], needs_torch: bool) -> dict[str, Any]:
    t0 = time.monotonic()
    why = ck.not_runnable(needs_torch)
    if why is None and ck.limit(math.inf) < 5:
        why = "the check's time budget is spent: not run"
    if why is not None:
        row: dict[str, Any] = {"ok": False, "not_run": True, "reason": why}
    else:
        try:
            row = fn(ck)
        except Exception as exc:  # noqa: BLE001 - one step's failure is its row's finding; the others still run
            row = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600]}
    return {"check": name, "ok": bool(row.pop("ok")), "seconds": round(time.monotonic() - t0, 2), **row}


# ---------------------------------------------------------------- set-up and output


def prepare_out(given: str | None) -> Path:
    """A fresh output directory: the one given (created, or empty), else a new temporary one."""
    if given is None:
        return Path(tempfile.mkdtemp(prefix="gpu-check-"))
    out = Path(given).absolute()
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise FileExistsError(f"--out {out}: exists and is not an empty directory; nothing is overwritten")
    out.mkdir(mode=0o700, parents=True, exist_ok=True)
    return out


def importable_gpuguard() -> str | None:
    """Make `import gpuguard` work here and in every child: an install, else this checkout through a
    link named gpuguard (the package is the repository root). Returns the link's folder, to remove."""
    if importlib.util.find_spec("gpuguard") is not None:
        return None
    link_dir = tempfile.mkdtemp(prefix="gpu-check-path-")
    os.symlink(REPO, Path(link_dir) / "gpuguard")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (link_dir, os.environ.get("PYTHONPATH"))))
    sys.path.insert(0, link_dir)
    return link_dir


def environment(out: Path) -> dict[str, Any]:
    """torch, its CUDA build, the device and NCCL, read in a child with a deadline (a hung driver
    cannot hang the check)."""
    log = out / "environment.log"
    rc = run([PY, "-c", FACTS], timeout=120, log=log, stdout=out / "environment.json")
    facts = read_json(out / "environment.json")
    if not isinstance(facts, dict):
        return {"torch": None, "torch_error": f"probe exited {rc}: {tail(log, 300)}"}
    return facts


def describe(facts: dict[str, Any]) -> str:
    if not facts.get("torch"):
        return f"no torch ({facts.get('torch_error')})"
    build = f"CUDA {facts['torch_cuda_build']} build" if facts.get("torch_cuda_build") else "CPU build, no CUDA"
    text = f"torch {facts['torch']} ({build})"
    if facts.get("cuda_available"):
        text += f", {facts.get('device_count')} x {facts.get('device_name')} (sm {facts.get('capability')})"
    elif facts.get("torch_cuda_build"):
        text += ", no GPU visible"
    if facts.get("nccl_version"):
        text += f", NCCL {facts['nccl_version']}"
    if facts.get("driver_version"):
        text += f", driver {facts['driver_version']}"
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the gpuguard.bench/1 document")
    ap.add_argument("--out", help="output directory (new or empty); default: a fresh temporary one")
    ap.add_argument("--dry-run-cpu", action="store_true", help="rehearse every step on the CPU (CI)")
    ap.add_argument("--budget", type=float, default=450.0, help="seconds for the whole check (default 450)")
    a = ap.parse_args(argv)
    try:
        out = prepare_out(a.out)
    except (FileExistsError, OSError) as exc:
        print(f"gpu_check: {exc}", file=sys.stderr)
        return 64
    link_dir = importable_gpuguard()
    try:
        facts = environment(out)
        ck = Check(out, a.dry_run_cpu, facts, a.budget)
        rows = []
        for name, fn, needs_torch in STEPS:
            rows.append(run_step(ck, name, fn, needs_torch))
            if name == "nvml_live" and not ck.dry:
                facts["driver_version"] = rows[-1].get("driver_version")
    finally:
        if link_dir:
            shutil.rmtree(link_dir, ignore_errors=True)
    notes = ["CPU rehearsal (--dry-run-cpu): nothing in it is a GPU result"] if a.dry_run_cpu else []
    doc = {
        "schema": SCHEMA,
        "bench": "gpu_check",
        "dry_run_cpu": a.dry_run_cpu,
        "environment": facts,
        "out": str(out),
        "results": rows,
        "notes": notes,
    }
    (out / "gpu-check.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if a.json:
        print(json.dumps(doc, indent=2, default=str))
    else:
        print(f"gpu_check: {describe(facts)}")
        for note in notes:
            print(f"note: {note}")
        for r in rows:
            text = r.get("error") or r.get("reason") or r.get("finding", "")
            print(f"{'ok  ' if r['ok'] else 'FAIL'} {r['check']:<14} {r['seconds']:>7.1f} s  {text}")
        print(f"artefacts: {out}")
    return 0 if rows and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
