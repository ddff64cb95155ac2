"""Fresh certificates and kubeconfigs for one throw-away local control plane.

Everything is ECDSA P-256: generating a key takes microseconds (RSA 2048 takes ~50 ms
each), and kube-apiserver accepts EC keys for serving, client certs and service-account
token signing (ES256). Files are written with mode 0600 into the given directory; nothing
here is meant to outlive the cluster it was made for. `sign()` issues further leaf certificates
from the same CA (the real node's kubelet and kube-proxy, the apiserver's kubelet client, the
LeaderWorkerSet webhook server).
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The apiserver's own ClusterIP is the first address of the service range.
SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"
_VALIDITY = datetime.timedelta(days=7)


@dataclass(frozen=True, slots=True)
class Pki:
    """Paths of every PEM file the components need."""

    ca_crt: Path
    ca_key: Path
    apiserver_crt: Path
    apiserver_key: Path
    admin_crt: Path
    admin_key: Path
    sa_key: Path  # service-account token signing key (private)
    sa_pub: Path  # its public half, for token verification


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


def _key_usage(is_ca: bool) -> x509.KeyUsage:
    """Signing only; a CA also signs certificates and revocation lists."""
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=is_ca,
        crl_sign=is_ca,
        encipher_only=False,
        decipher_only=False,
    )


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
    )


def _leaf(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    subject: x509.Name,
    usage: x509.ObjectIdentifier,
    sans: list[x509.GeneralName] | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = _key()
    builder = (
        _builder(subject, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            _key_usage(is_ca=False),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def make_pki(
    directory: Path, api_ips: tuple[str, ...] = ("127.0.0.1",), service_ip: str = KUBERNETES_SERVICE_IP
) -> Pki:
    """Create a CA, the apiserver serving cert (for `api_ips` and the `kubernetes` Service's
    `service_ip`), an admin client cert and SA keys."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_name = _name("tidepool-dev-ca")
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            _key_usage(is_ca=True),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    dns = [
        "localhost",
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    ips = list(dict.fromkeys(["127.0.0.1", *api_ips, service_ip]))
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    server_cert, server_key = _leaf(ca_cert, ca_key, _name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, sans)
    admin_cert, admin_key = _leaf(
        ca_cert,
        ca_key,
        _name("kubernetes-admin", "system:masters"),
        ExtendedKeyUsageOID.CLIENT_AUTH,
    )
    sa_key = _key()

    pki = Pki(
        ca_crt=directory / "ca.crt",
        ca_key=directory / "ca.key",
        apiserver_crt=directory / "apiserver.crt",
        apiserver_key=directory / "apiserver.key",
        admin_crt=directory / "admin.crt",
        admin_key=directory / "admin.key",
        sa_key=directory / "sa.key",
        sa_pub=directory / "sa.pub",
    )
    _write_cert(pki.ca_crt, ca_cert)
    _write_key(pki.ca_key, ca_key)
    _write_cert(pki.apiserver_crt, server_cert)
    _write_key(pki.apiserver_key, server_key)
    _write_cert(pki.admin_crt, admin_cert)
    _write_key(pki.admin_key, admin_key)
    _write_key(pki.sa_key, sa_key)
    pki.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    return pki


def sign(
    pki: Pki,
    stem: str,
    common_name: str,
    organization: str | None = None,
    *,
    server: bool = False,
    dns: tuple[str, ...] = (),
    ips: tuple[str, ...] = (),
) -> tuple[Path, Path]:
    """A leaf cert from the cluster CA, written as `<stem>.crt`/`<stem>.key` beside it: a client cert
    (CN = user, O = group), or with `server=True` a serving cert for `dns` and `ips`."""
    ca_cert = x509.load_pem_x509_certificate(pki.ca_crt.read_bytes())
    # make_pki wrote it: always an EC key
    ca_key = cast(ec.EllipticCurvePrivateKey, serialization.load_pem_private_key(pki.ca_key.read_bytes(), None))
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
    usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
    cert, key = _leaf(ca_cert, ca_key, _name(common_name, organization), usage, sans or None)
    crt_path, key_path = pki.ca_crt.with_name(f"{stem}.crt"), pki.ca_crt.with_name(f"{stem}.key")
    _write_cert(crt_path, cert)
    _write_key(key_path, key)
    return crt_path, key_path


def write_kubeconfig(
    path: Path, server: str, pki: Pki, name: str = "tidepool-dev", client: tuple[Path, Path] | None = None
) -> None:
    """A kubeconfig with every credential embedded (no file references): the admin's, or `client`'s
    (cert, key) pair from `sign()`."""
    client_crt, client_key = client or (pki.admin_crt, pki.admin_key)

    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": name,
                "cluster": {"server": server, "certificate-authority-data": b64(pki.ca_crt)},
            }
        ],
        "users": [
            {
                "name": f"{name}-admin",
                "user": {
                    "client-certificate-data": b64(client_crt),
                    "client-key-data": b64(client_key),
                },
            }
        ],
        "contexts": [
            {
                "name": name,
                "context": {"cluster": name, "user": f"{name}-admin", "namespace": "default"},
            }
        ],
        "current-context": name,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
