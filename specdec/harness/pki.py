"""Throwaway TLS material for tests and benchmarks (the ``cryptography`` package): a CA and a certificate it signed."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path


def make_pki(root: Path, label: str = "") -> dict[str, Path]:
    """A throwaway CA and one certificate it signed for 127.0.0.1 / localhost (servers and clients both present
    it): {"ca", "cert", "key"} PEM files ``{label}ca.pem``, ``{label}cert.pem``, ``{label}key.pem`` under ``root``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"specdec {label}throwaway CA")])

    def signed(subject: x509.Name, public_key, ca: bool, extra: list) -> x509.Certificate:
        builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(public_key)
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=2))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
                   .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))
        for extension in extra:
            builder = builder.add_extension(extension, critical=False)
        return builder.sign(ca_key, hashes.SHA256())

    ca = signed(ca_name, ca_key.public_key(), True, [])
    cert = signed(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]), key.public_key(), False, [
        x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
        x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key())])
    root.mkdir(parents=True, exist_ok=True)
    files = {name: root / f"{label}{name}.pem" for name in ("ca", "cert", "key")}
    files["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    files["key"].write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    files["key"].chmod(0o600)
    return files
