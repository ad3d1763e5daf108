"""Ledger and manifest speed: activation latency on both backends, `verify --deep` against `cat`,
manifest build time for 100,000 objects.

    python bench/ledger.py [--json] [--size-gib 2] [--activations 200]

Starts a throwaway etcd on loopback unless $GPUGUARD_TEST_ETCD names one. The checkpoint is
written with torch.distributed.checkpoint into a temp dir that is deleted afterwards.
"""

from __future__ import annotations

import os
import pickle
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import emit, wants_json  # noqa: E402

from gpuguard.generation.certificate import issue  # noqa: E402
from gpuguard.generation.ledger_open import open_ledger  # noqa: E402
from gpuguard.generation.records import Frontier, Incarnation, Member  # noqa: E402

KEY = os.urandom(32)


def _arg(name: str, default: float) -> float:
    argv = sys.argv[1:]
    return float(argv[argv.index(name) + 1]) if name in argv else default


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def etcd_server():
    """$GPUGUARD_TEST_ETCD, or a throwaway etcd on loopback."""
    url = os.environ.get("GPUGUARD_TEST_ETCD")
    if url:
        yield url
        return
    etcd = shutil.which("etcd") or "/usr/bin/etcd"
    data = tempfile.mkdtemp(prefix="bench-etcd-")
    port, peer = _port(), _port()
    proc = subprocess.Popen(
        [
            etcd,
            "--name",
            "b",
            "--data-dir",
            data,
            "--listen-client-urls",
            f"http://127.0.0.1:{port}",
            "--advertise-client-urls",
            f"http://127.0.0.1:{port}",
            "--listen-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls",
            f"http://127.0.0.1:{peer}",
            "--initial-cluster",
            f"b=http://127.0.0.1:{peer}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("etcd did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        shutil.rmtree(data, ignore_errors=True)


def activation_latency(backend: str, url: str | None, n: int) -> dict:
    job = Path(tempfile.mkdtemp(prefix="bench-ledger-"))
    try:
        led = open_ledger(job, url, key=KEY)
        if hasattr(led, "create_root"):
            led.create_root()
        mem = tuple(Member(r, Incarnation(uuid.uuid4().hex, "h", 100 + r, 1.0)) for r in range(8))
        cert = issue(
            parent=None,
            job_id="bench",
            members=(),
            reason="genesis",
            frontier=Frontier(0),
            quiescence="proved",
            issued_by="bench",
            key=KEY,
        )
        led.initialize(cert)
        times = []
        for _ in range(n):
            nxt = issue(
                parent=cert,
                job_id="bench",
                members=mem,
                reason="operator",
                frontier=Frontier(0),
                quiescence="proved",
                issued_by="bench",
                key=KEY,
            )
            t = time.perf_counter()
            led.activate(nxt)
            times.append(time.perf_counter() - t)
            cert = nxt
        q = statistics.quantiles(times, n=100)
        return {
            "metric": f"activation latency ({backend})",
            "n": n,
            "p50_ms": round(q[49] * 1e3, 3),
            "p99_ms": round(q[98] * 1e3, 3),
            "baseline": "-",
            "ratio": None,
        }
    finally:
        shutil.rmtree(job, ignore_errors=True)


def deep_verify(size_gib: float) -> list[dict]:
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from gpuguard.generation.manifest import build_manifest, verify_manifest, write_manifest

    warnings.filterwarnings("ignore")
    need = int(size_gib * 2**30)
    free = shutil.disk_usage(tempfile.gettempdir()).free
    if free < need * 1.5:
        raise SystemExit(
            f"bench: {free / 2**30:.1f} GiB free in {tempfile.gettempdir()}, need {need * 1.5 / 2**30:.1f}"
        )
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    try:
        n_tensors = 4
        per = need // n_tensors // 4  # float32 elements
        state = {f"model.layer{i}.weight": torch.ones(per, dtype=torch.float32) * i for i in range(n_tensors)}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(root, thread_count=4))
        del state
        man = build_manifest(root, step=0, generation=1)
        write_manifest(man, root)
        files = sorted(str(p) for p in root.glob("*.distcp"))
        total = sum(os.path.getsize(f) for f in files)
        subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)  # into the page cache
        cat_s = min(
            _timed(lambda: subprocess.run(["cat", *files], stdout=subprocess.DEVNULL, check=True)) for _ in range(3)
        )
        ver_s = min(_timed(lambda: _assert_ok(verify_manifest(man, root))) for _ in range(3))
        job = root / "job"
        subprocess.run(
            [str(Path(sys.executable).parent / "gpu-generation"), "init", "--job-dir", str(job)],
            check=True,
            capture_output=True,
        )
        led = open_ledger(job)
        g0 = led.require_active()
        ck = job / "ckpt"
        ck.mkdir()
        for p in root.iterdir():
            if p.is_file():
                os.link(p, ck / p.name)
        mem = (Member(0, Incarnation(uuid.uuid4().hex, "h", 1, 1.0)),)
        led.activate(
            issue(
                parent=g0,
                job_id=g0.job_id,
                members=mem,
                reason="start",
                frontier=Frontier(0, man.digest),
                quiescence="proved",
                issued_by="bench",
                key=led.key,
            ),
            manifest_ok=True,
        )
        cli = [str(Path(sys.executable).parent / "gpu-generation"), "verify", "--deep", "--job-dir", str(job)]
        cli_s = min(_timed(lambda: subprocess.run(cli, check=True, capture_output=True)) for _ in range(2))
        gb = total / 1e9
        return [
            {
                "metric": "cat FILES > /dev/null (page cache)",
                "bytes": total,
                "seconds": round(cat_s, 3),
                "GB_per_s": round(gb / cat_s, 2),
                "baseline": "-",
                "ratio": None,
            },
            {
                "metric": "verify_manifest (BLAKE3 re-hash)",
                "bytes": total,
                "seconds": round(ver_s, 3),
                "GB_per_s": round(gb / ver_s, 2),
                "baseline": "cat",
                "ratio": round(cat_s / ver_s, 3),
            },
            {
                "metric": "gpu-generation verify --deep (whole command)",
                "bytes": total,
                "seconds": round(cli_s, 3),
                "GB_per_s": round(gb / cli_s, 2),
                "baseline": "cat",
                "ratio": round(cat_s / cli_s, 3),
            },
        ]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _assert_ok(problems: list[str]) -> None:
    if problems:
        raise SystemExit(f"bench: verification failed: {problems[:2]}")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def manifest_build(n: int) -> dict:
    """Build a manifest of `n` objects from DCP metadata (as DCP's planner hands it over)."""
    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    from gpuguard.generation.manifest import build_manifest

    root = Path(tempfile.mkdtemp(prefix="bench-manifest-"))
    try:
        item = 256
        (root / "__0_0.distcp").write_bytes(os.urandom(n * item))
        sdm, storage = {}, {}
        for i in range(n):
            fqn = f"model.layers.{i // 8}.p{i % 8}"
            sdm[fqn] = TensorStorageMetadata(
                TensorProperties(dtype=torch.float32),
                torch.Size([64]),
                [ChunkStorageMetadata(torch.Size([0]), torch.Size([64]))],
            )
            storage[MetadataIndex(fqn, torch.Size([0]), 0)] = _StorageInfo("__0_0.distcp", i * item, item)
        meta = Metadata(state_dict_metadata=sdm, storage_data=storage)
        (root / ".metadata").write_bytes(pickle.dumps(meta))  # the manifest binds the file's bytes
        t = time.perf_counter()
        man = build_manifest(root, step=1, generation=1, owners={0: "inc"}, metadata=meta)
        _ = man.digest
        s = time.perf_counter() - t
        return {
            "metric": f"manifest build ({n} objects, incl. Merkle root)",
            "n": n,
            "seconds": round(s, 3),
            "objects_per_s": round(n / s),
            "baseline": "-",
            "ratio": None,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    n = int(_arg("--activations", 200))
    results = [activation_latency("directory", None, n)]
    with etcd_server() as url:
        u = url.replace("http://", "")
        results.append(activation_latency("etcd", f"etcd://{u}/bench-{uuid.uuid4().hex}", n))
    results += deep_verify(_arg("--size-gib", 2.0))
    results.append(manifest_build(int(_arg("--objects", 100_000))))
    emit(
        "ledger",
        results,
        wants_json(),
        notes=[
            f"{os.cpu_count()} CPUs; shared machine, figures are noisy",
            "directory activation = temp write + fsync + link + directory fsync; etcd = one v3 transaction",
            "ratio = cat time / our time (>= 0.5 is the target for verify --deep)",
        ],
    )


if __name__ == "__main__":
    main()
