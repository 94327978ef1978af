"""Certificates generated for the test with the openssl CLI: a CA, a server certificate
for 127.0.0.1/localhost, a client certificate from that CA, and a rogue client
certificate from another CA."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(name: str, cwd: Path) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-subj", f"/CN={name}", cwd=cwd)


def _signed(name: str, ca: str, cwd: Path, ext: str) -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=cwd)
    (cwd / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-days", "2", "-out", f"{name}.pem", "-extfile", f"{name}.ext",
             cwd=cwd)


@pytest.fixture(scope="session")
def certs(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to generate test certificates")
    d = tmp_path_factory.mktemp("certs")
    _ca("ca", d)
    _ca("rogue-ca", d)
    _signed("server", "ca", d, "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
            "extendedKeyUsage=serverAuth\n")
    _signed("client", "ca", d, "extendedKeyUsage=clientAuth\n")
    _signed("rogue", "rogue-ca", d, "extendedKeyUsage=clientAuth\n")
    return {name: str(d / name) for name in ("ca", "server", "client", "rogue")}
