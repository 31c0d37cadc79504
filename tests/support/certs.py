"""Certificates made at test time with the ``openssl`` CLI: a CA, and a server and a client
certificate it signs, for TLS and mutual-TLS tests against real servers."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Pki:
    """The PEM files of one test CA and the two certificates it signed."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_pki(directory: Path, *, ca_name: str, server_alt_names: str) -> Pki:
    """Write a CA (common name ``ca_name``), a server certificate for ``server_alt_names`` (an
    openssl subjectAltName value, e.g. ``IP:127.0.0.1,DNS:localhost``) and a client certificate
    into ``directory``, all valid for two days."""
    d = directory
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "2", "-subj", f"/CN={ca_name}", cwd=d)
    (d / "server.ext").write_text(f"subjectAltName={server_alt_names}\n"
                                  "extendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
                f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile",
                f"{name}.ext", cwd=d)
    return Pki(ca=d / "ca.pem", server_cert=d / "server.pem", server_key=d / "server.key",
               client_cert=d / "client.pem", client_key=d / "client.key")


def issue_server_cert(pki: Pki, directory: Path, *, name: str,
                      server_alt_names: str) -> tuple[Path, Path]:
    """Another server certificate (common name ``name``) signed by ``pki``'s CA, as a renewal
    would issue it: ``(certificate, key)`` written into ``directory``."""
    d = directory
    (d / f"{name}.ext").write_text(f"subjectAltName={server_alt_names}\n"
                                   "extendedKeyUsage=serverAuth\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
            f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", str(pki.ca), "-CAkey",
            str(pki.ca.with_name("ca.key")), "-CAcreateserial", "-out", f"{name}.pem", "-days",
            "2", "-extfile", f"{name}.ext", cwd=d)
    return d / f"{name}.pem", d / f"{name}.key"
