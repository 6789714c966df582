"""A throw-away certificate authority for the TLS API server of the tests: a CA, a server
certificate for 127.0.0.1, and a client certificate, as PEM bytes."""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@dataclass(frozen=True)
class Certificates:
    ca: bytes
    server_cert: bytes
    server_key: bytes
    client_cert: bytes
    client_key: bytes

    @classmethod
    def generate(cls, client: str = "kvtier-test") -> Certificates:
        now = dt.datetime.now(dt.UTC)
        ca_key = _key()
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvtier-test-ca")])
        ca = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
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

        def issue(
            name: str, usage: x509.ObjectIdentifier, san: x509.GeneralName | None
        ) -> tuple[bytes, bytes]:
            key = _key()
            builder = (
                x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_name)
                .public_key(key.public_key())
                .serial_number(x509.random_serial_number())
                .not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=1))
                .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            )
            if san is not None:
                builder = builder.add_extension(x509.SubjectAlternativeName([san]), critical=False)
            cert = builder.sign(ca_key, hashes.SHA256())
            return cert.public_bytes(serialization.Encoding.PEM), _pem(key)

        server_cert, server_key = issue(
            "kube-apiserver",
            ExtendedKeyUsageOID.SERVER_AUTH,
            x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        )
        client_cert, client_key = issue(client, ExtendedKeyUsageOID.CLIENT_AUTH, None)
        return cls(
            ca=ca.public_bytes(serialization.Encoding.PEM),
            server_cert=server_cert,
            server_key=server_key,
            client_cert=client_cert,
            client_key=client_key,
        )
