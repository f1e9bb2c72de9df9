"""TLS and the auth token: a self-signed certificate (openssl) and a token file, on the tiny
model; the health service stays open to probes that carry no token."""
from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys

import pytest

from cloud_server.reference import plain_greedy
from cloud_server.rpc.security import Security
from edge_client.client import ClientOptions, EdgeClient
from edge_client.link import LinkConfig, LinkError
from edge_client.security import ClientSecurity
from shared.messages import Limits
from cloud_server.config import ServerConfig
from tests.server_harness import ServerThread

PROMPT = (5, 6, 7, 8, 5, 6, 7)
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: no certificate to test with")
    path = tmp_path_factory.mktemp("pki")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-keyout", str(path / "key.pem"), "-out", str(path / "cert.pem"),
                    "-subj", "/CN=localhost", "-addext",
                    "subjectAltName=DNS:localhost,IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    (path / "token").write_text(TOKEN + "\n")
    return path


@pytest.fixture(scope="module")
def secure_server(tiny_target, pki):
    security = Security.from_files(str(pki / "cert.pem"), str(pki / "key.pem"),
                                   str(pki / "token"))
    limits = Limits(max_tree_nodes=16, max_tree_depth=8, max_new_tokens=64)
    with ServerThread(tiny_target, ServerConfig(limits), security=security) as server:
        yield server


def generate(address: str, security: ClientSecurity) -> list[int]:
    async def go() -> list[int]:
        config = LinkConfig(connect_timeout_s=3.0, security=security)
        async with EdgeClient(address, ClientOptions("pld", 4, 12), config) as client:
            result = await client.generate(client.options.open_request(prompt_ids=PROMPT))
            return result.output_ids
    return asyncio.run(go())


def test_tls_with_the_token_generates_exactly(secure_server, tiny_target, pki):
    ca = (pki / "cert.pem").read_bytes()
    assert generate(secure_server.address, ClientSecurity(True, ca, TOKEN)) == plain_greedy(
        tiny_target, PROMPT, 12)


@pytest.mark.parametrize("token", [None, "wrong"])
def test_a_missing_or_wrong_token_is_refused(secure_server, pki, token):
    with pytest.raises(LinkError, match="unauthenticated"):
        generate(secure_server.address,
                 ClientSecurity(True, (pki / "cert.pem").read_bytes(), token))


def test_a_plaintext_client_cannot_talk_to_a_tls_server(secure_server):
    with pytest.raises(LinkError, match="cannot reach|did not answer"):
        generate(secure_server.address, ClientSecurity(auth_token=TOKEN))


def test_tls_and_token_from_the_cli_and_health_without_token(secure_server, pki):
    edge = [sys.executable, "-m", "edge_client.cli", "--server", secure_server.address,
            "--drafter", "pld", "--max-new-tokens", "4", "--tls-ca", str(pki / "cert.pem")]
    ok = subprocess.run(edge + ["--auth-token-file", str(pki / "token"), "hi"],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    refused = subprocess.run(edge + ["hi"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 3 and "unauthenticated" in refused.stderr
    missing = subprocess.run(edge + ["--auth-token-file", str(pki / "nope"), "hi"],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    health = [sys.executable, "-m", "cloud_server.cli", "health", "--server",
              secure_server.address, "--tls-ca", str(pki / "cert.pem")]
    for name, code in ((None, 0), ("localhost", 0), ("elsewhere.example", 1)):
        extra = [] if name is None else ["--tls-name", name]  # as a probe dialling 127.0.0.1
        checked = subprocess.run(health + extra, capture_output=True, text=True, timeout=60)
        assert checked.returncode == code, (name, checked.stderr)


def test_a_key_without_a_certificate_is_refused(pki):
    with pytest.raises(ValueError, match="go together"):
        Security.from_files(None, str(pki / "key.pem"), None)


@pytest.fixture(scope="module")
def mtls(tmp_path_factory, pki):
    """A CA, and two client certificates it signed ("alice", "bob")."""
    path = tmp_path_factory.mktemp("mtls")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=edge-ca",
            "-keyout", str(path / "ca.key"), "-out", str(path / "ca.pem"))
    for name in ("alice", "bob"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}",
                "-keyout", str(path / f"{name}.key"), "-out", str(path / f"{name}.csr"))
        openssl("x509", "-req", "-in", str(path / f"{name}.csr"), "-CA", str(path / "ca.pem"),
                "-CAkey", str(path / "ca.key"), "-CAcreateserial", "-days", "1",
                "-out", str(path / f"{name}.pem"))
    return path


@pytest.fixture(scope="module")
def mtls_server(tiny_target, pki, mtls):
    security = Security.from_files(str(pki / "cert.pem"), str(pki / "key.pem"), None,
                                   str(mtls / "ca.pem"))
    limits = Limits(max_tree_nodes=16, max_tree_depth=8, max_new_tokens=64)
    with ServerThread(tiny_target, ServerConfig(limits), security=security) as server:
        yield server


def client_security(pki, mtls, name: str | None) -> ClientSecurity:
    return ClientSecurity(True, (pki / "cert.pem").read_bytes(), None,
                          None if name is None else (mtls / f"{name}.pem").read_bytes(),
                          None if name is None else (mtls / f"{name}.key").read_bytes())


def test_mutual_tls_lets_certified_clients_in_and_keeps_others_out(mtls_server, tiny_target,
                                                                   pki, mtls):
    assert generate(mtls_server.address, client_security(pki, mtls, "alice")) == plain_greedy(
        tiny_target, PROMPT, 12)
    with pytest.raises(LinkError, match="cannot reach|did not answer|unavailable"):
        generate(mtls_server.address, client_security(pki, mtls, None))


def test_only_the_client_that_opened_a_session_may_resume_it(mtls_server, pki, mtls):
    import grpc

    from shared.messages import PROTOCOL_VERSION
    from shared.pb.splitdec.v1 import splitdec_pb2 as pb
    from shared.pb.splitdec.v1 import splitdec_pb2_grpc as pb_grpc

    def decode(name: str, opening: pb.Open) -> list:
        creds = grpc.ssl_channel_credentials((pki / "cert.pem").read_bytes(),
                                             (mtls / f"{name}.key").read_bytes(),
                                             (mtls / f"{name}.pem").read_bytes())
        with grpc.secure_channel(mtls_server.address, creds) as channel:
            call = pb_grpc.SplitDecodingStub(channel).Decode(
                iter([pb.ClientMessage(open=opening)]), timeout=20)
            return list(call)  # the stream ends: the session waits for a resume

    opened = decode("alice", pb.Open(input_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=12,
                                     protocol_version=PROTOCOL_VERSION))
    sid, first = opened[0].opened.session_id, list(opened[1].verdict.tokens)
    resume = pb.Open(input_ids=pb.TokenIds(ids=PROMPT), max_new_tokens=12,
                     protocol_version=PROTOCOL_VERSION,
                     resume=pb.Resume(session_id=sid, generated_ids=first))
    with pytest.raises(grpc.RpcError) as refused:
        decode("bob", resume)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "another client" in refused.value.details()
    assert decode("alice", resume)[0].opened.resumed


def test_the_edge_takes_its_token_from_the_environment(secure_server, pki):
    import os

    edge = [sys.executable, "-m", "edge_client.cli", "--server", secure_server.address,
            "--drafter", "pld", "--max-new-tokens", "4", "--tls-ca", str(pki / "cert.pem"), "hi"]
    env = {**os.environ, "SPLITDEC_AUTH_TOKEN": TOKEN}
    ok = subprocess.run(edge, capture_output=True, text=True, timeout=60, env=env)
    assert ok.returncode == 0, ok.stderr
    env["SPLITDEC_AUTH_TOKEN"] = "wrong"
    refused = subprocess.run(edge, capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 3 and "unauthenticated" in refused.stderr


def test_a_client_ca_without_a_server_certificate_is_refused(mtls):
    with pytest.raises(ValueError, match="needs --tls-cert"):
        Security.from_files(None, None, None, str(mtls / "ca.pem"))
