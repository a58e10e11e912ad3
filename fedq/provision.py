"""``fedq provision``: a small certificate authority and one folder per party, for
mutual TLS between the coordinator's services and every machine (NVIDIA FLARE's
startup kits, in the way Redis and PostgreSQL take certificates).

``fedq provision DIR --host redis.example.org --worker w1 --worker w2`` writes::

    DIR/ca.crt  DIR/ca.key              the CA (keep ca.key on the coordinator's host)
    DIR/server/server.crt, server.key   for Redis / PostgreSQL / MinIO (names: --host)
    DIR/coordinator/client.crt, .key    the control worker's, beat's and the CLI's
    DIR/workers/NAME/client.crt, .key   each worker's (copy its folder to its machine)

with ``ca.crt`` in every folder. Run again with more ``--worker`` names to add workers:
the CA and the certificates already made are kept. Keys are ECDSA P-256, which Redis,
PostgreSQL, OpenSSL and Python's ``ssl`` all accept. Everything is made with the
``cryptography`` package; private keys are written with mode 600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from fedq.errors import ConfigError
from fedq.files import write_whole

VALID_DAYS = 825  # the longest TLS server certificate lifetime browsers still accept
CA_NAME = "fedq CA"


@dataclass(frozen=True)
class Made:
    path: Path
    new: bool


def provision(folder: Path, hosts: list[str], workers: list[str]) -> list[Made]:
    """Make (or keep) the CA, the server's, the coordinator's and each worker's
    certificate under ``folder``. Returns each party's folder and whether it is new."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca(folder)
    made = [_party(folder / "server", "server", ca_key, ca_cert, server_names=hosts),
            _party(folder / "coordinator", "client", ca_key, ca_cert, common="coordinator")]
    made += [_party(folder / "workers" / name, "client", ca_key, ca_cert, common=name)
             for name in workers]
    return made


def _ca(folder: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key_path, cert_path = folder / "ca.key", folder / "ca.crt"
    if key_path.exists() and cert_path.exists():
        try:
            key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
            cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        except ValueError as exc:
            raise ConfigError(f"{folder}: its CA is unreadable ({exc})") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ConfigError(f"{key_path}: not an EC private key")
        return key, cert
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, CA_NAME)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=10 * 365))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True,
                                         crl_sign=True, content_commitment=False,
                                         key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False,
                                         decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    _write(key_path, _key_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def _party(folder: Path, role: str, ca_key: ec.EllipticCurvePrivateKey,
           ca_cert: x509.Certificate, common: str = "", server_names: list[str] | None = None
           ) -> Made:
    stem = "server" if role == "server" else "client"
    cert_path = folder / f"{stem}.crt"
    if cert_path.exists():
        return Made(folder, False)
    names = server_names or []
    if role == "server" and not names:
        raise ConfigError("name the host(s) the services are reached at: --host NAME")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common or names[0])])
    now = datetime.datetime.now(datetime.timezone.utc)
    usage = ExtendedKeyUsageOID.SERVER_AUTH if role == "server" \
        else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_cert.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
    if names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([_general_name(n) for n in names]), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    _write(folder / f"{stem}.key", _key_pem(key), private=True)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM))
    _write(folder / "ca.crt", ca_cert.public_bytes(serialization.Encoding.PEM))
    return Made(folder, True)


def _general_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM,
                             serialization.PrivateFormat.TraditionalOpenSSL,
                             serialization.NoEncryption())


def _write(path: Path, data: bytes, private: bool = False) -> None:
    write_whole(path, data, 0o600 if private else 0o644)
