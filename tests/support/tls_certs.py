"""A throw-away CA, a server certificate for 127.0.0.1 and a client certificate, made with the
`openssl` command line (no network, no Python crypto package): what a TLS test of etcd needs."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certs:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed none of them


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> tuple[Path, Path]:
    key, cert = d / f"{name}.key", d / f"{name}.pem"
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN={name}",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    return cert, key


def _leaf(d: Path, name: str, ca: tuple[Path, Path], ext: str) -> tuple[Path, Path]:
    key, csr, cert, extfile = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.pem", d / f"{name}.ext"
    extfile.write_text(ext)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key,
             "-out", csr, "-subj", f"/CN={name}")  # fmt: skip
    _openssl("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-CAcreateserial", "-out", cert,
             "-days", "2", "-extfile", extfile)  # fmt: skip
    key.chmod(0o600)
    return cert, key


def make_certs(d: Path) -> Certs:
    """Certificates under `d` (raises RuntimeError when there is no `openssl`)."""
    if shutil.which("openssl") is None:
        raise RuntimeError("no openssl command line: the TLS test needs it to make its certificates")
    d.mkdir(parents=True, exist_ok=True)
    ca = _ca(d, "ca")
    other, _ = _ca(d, "other-ca")
    server = _leaf(d, "server", ca, "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    client = _leaf(d, "client", ca, "extendedKeyUsage=clientAuth\n")
    return Certs(ca[0], server[0], server[1], client[0], client[1], other)
