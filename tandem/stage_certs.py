"""Throwaway certificates for mutual TLS between the stages of one host (`tandem up --stage-mtls
auto`): a CA made for this start, whose key never leaves memory, and one certificate per process
signed by it.

A worker's certificate serves its stage port and is the one it presents to the stages it calls
(decode to prefill and draft), so it allows both uses; the gateway serves no stage port and gets
a client certificate only. Every certificate names the hosts the stages are dialled by. Each
file is written mode 0600 into a folder the caller owns (and removes).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# Long enough never to expire under a running `tandem up` (its stages restart with the same
# files); nothing outlives it: the files go at exit and the CA's key is never written.
VALIDITY = datetime.timedelta(days=3650)


@dataclass(frozen=True)
class StageCertFiles:
    """PEM files of one process: the CA bundle, its certificate and its private key."""

    ca: str
    cert: str
    key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def _write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_stage_certs(
    directory: str, workers: list[str], clients: list[str], hosts: list[str]
) -> dict[str, StageCertFiles]:
    """A new CA and, for each of `workers` (serve and call) and `clients` (call only), a key and
    a certificate naming `hosts` (IP addresses or DNS names), written into `directory`:
    {process: its files}."""
    now = datetime.datetime.now(datetime.UTC)
    start = now - datetime.timedelta(minutes=5)  # a clock a little behind still accepts them
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("tandem stage CA (tandem up)")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_path = os.path.join(directory, "ca.crt")
    _write(ca_path, ca.public_bytes(serialization.Encoding.PEM))
    out = {}
    for process in [*workers, *clients]:
        key = ec.generate_private_key(ec.SECP256R1())
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if process in workers:
            usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(f"tandem {process}"))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(now + VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(_san(hosts), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        files = StageCertFiles(
            ca=ca_path,
            cert=os.path.join(directory, f"{process}.crt"),
            key=os.path.join(directory, f"{process}.key"),
        )
        _write(files.cert, cert.public_bytes(serialization.Encoding.PEM))
        _write(
            files.key,
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )
        out[process] = files
    return out
