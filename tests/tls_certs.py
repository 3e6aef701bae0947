"""Throwaway certificates for tests (the ``cryptography`` package): a CA, and certificates it signs."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

NOW = datetime.datetime.now(datetime.UTC)


class CA:
    """A certificate authority; :meth:`issue` writes a key and a certificate it signs."""

    def __init__(self, directory: Path, name: str) -> None:
        self.dir, self.name = directory, name
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        self.cert = (
            self._builder(subject, subject, self.key.public_key(), NOW, NOW + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )
            .sign(self.key, hashes.SHA256())
        )
        self.pem = self._write(f"{name}.pem", self.cert.public_bytes(serialization.Encoding.PEM))

    @staticmethod
    def _builder(subject, issuer, public_key, start, end) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
        )

    def _write(self, name: str, data: bytes) -> str:
        path = self.dir / name
        path.write_bytes(data)
        return str(path)

    def issue(
        self, name: str, hosts: tuple[str, ...] = ("localhost", "127.0.0.1"), expired: bool = False
    ) -> tuple[str, str]:
        """``(certificate, key)`` PEM paths for ``hosts`` (server and client use); ``expired``: ended an hour ago."""
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = []
        for h in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                names.append(x509.DNSName(h))
        start, end = NOW - datetime.timedelta(hours=1), NOW + datetime.timedelta(days=1)
        if expired:
            start, end = NOW - datetime.timedelta(days=2), NOW - datetime.timedelta(hours=1)
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            self._builder(subject, self.cert.subject, key.public_key(), start, end)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return (
            self._write(f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM)),
            self._write(f"{name}.key", key_pem),
        )
