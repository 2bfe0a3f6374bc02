"""A real S3 server for the tests: ``weed mini`` (SeaweedFS) on loopback, HTTP and HTTPS.

Every run gets a fresh data directory (``weed mini`` reloads flags from ``$DIR/mini.options``),
free random ports (each HTTP port's gRPC twin, port + 10000, must be free too) and credentials in
the server's environment, so request signatures are checked. Telemetry is off: no traffic leaves
127.0.0.1.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import ipaddress
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

ACCESS_KEY = "s4w-test-access"
SECRET_KEY = "s4w-test-secret-key-0123456789"
REGION = "us-east-1"
START_TIMEOUT_S = 30.0
GRPC_OFFSET = 10000


@dataclass
class SeaweedServer:
    proc: subprocess.Popen[bytes]
    data_dir: Path
    log_path: Path
    http_port: int
    https_port: int
    ca_bundle: Path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def https_endpoint(self) -> str:
        return f"https://127.0.0.1:{self.https_port}"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return "<no log>"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def pick_ports(count: int) -> int:
    """A base port P with P..P+count-1 and their gRPC twins free."""
    for _ in range(200):
        base = random.randrange(20000, 50000 - GRPC_OFFSET)
        wanted = [base + i for i in range(count)] + [base + GRPC_OFFSET + i for i in range(count)]
        if all(_port_free(p) for p in wanted):
            return base
    raise RuntimeError("no free block of loopback ports found for SeaweedFS")


def make_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (it is also the CA bundle clients trust)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def admin_client(endpoint: str, ca_bundle: Path | None = None, *, attempts: int = 3,
                 secret: str = SECRET_KEY):
    """A plain boto3 client with the server's credentials (no AWS config files involved)."""
    import boto3
    from botocore.config import Config
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, region_name=REGION, aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=secret, verify=str(ca_bundle) if ca_bundle else None,
        config=Config(retries={"mode": "standard", "total_max_attempts": attempts},
                      connect_timeout=2, read_timeout=10))


def _die_with_parent() -> None:
    # Linux: SIGTERM the server if the test process dies without running its teardown.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# Ports are found free, then bound by weed a moment later: another process may take one in
# between (seen once in CI: the filer's gRPC port). Such a start is tried again on new ports.
START_ATTEMPTS = 3


def start(root: Path) -> SeaweedServer:
    cert, key = make_cert(root)
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return _start(root / f"attempt-{attempt}", cert, key)
        except _PortTaken:
            if attempt == START_ATTEMPTS:
                raise
    raise AssertionError("unreachable")


class _PortTaken(RuntimeError):
    """weed exited because a port picked for it was taken before it bound it."""


def _start(root: Path, cert: Path, key: Path) -> SeaweedServer:
    weed = shutil.which("weed")
    assert weed, "weed not on PATH"
    data_dir = root / "data"
    data_dir.mkdir(parents=True)
    p = pick_ports(6)
    log_path = root / "weed.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
    args = [weed, "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-s3.port={p}", f"-master.port={p + 1}", f"-volume.port={p + 2}",
            f"-filer.port={p + 3}", f"-admin.port={p + 4}", f"-s3.port.https={p + 5}",
            f"-s3.cert.file={cert}", f"-s3.key.file={key}", "-admin.ui=false", "-webdav=false",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.autoCreateBucket=false",
            "-s3.allowDeleteBucketNotEmpty=false", "-master.telemetry=false"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                cwd=root, start_new_session=True, preexec_fn=_die_with_parent)
    server = SeaweedServer(proc, data_dir, log_path, p, p + 5, cert)
    try:
        _wait_ready(server)
    except BaseException:
        server.stop()
        raise
    return server


def _wait_ready(server: SeaweedServer) -> None:
    probe = admin_client(server.endpoint, attempts=1)
    deadline = time.monotonic() + START_TIMEOUT_S
    last: Exception | None = None
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            tail = server.log_tail()
            taken = "address already in use" in tail
            raise (_PortTaken if taken else RuntimeError)(
                f"weed mini exited with {server.proc.returncode}; log:\n{tail}")
        try:
            probe.create_bucket(Bucket="s4w-ready")
            probe.delete_bucket(Bucket="s4w-ready")
            return
        except Exception as exc:
            last = exc
            time.sleep(0.2)
    raise RuntimeError(f"SeaweedFS S3 on {server.endpoint} not ready after {START_TIMEOUT_S} s "
                       f"(last error: {last}); log:\n{server.log_tail()}")
