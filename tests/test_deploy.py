"""deploy/ without a container daemon: the YAML lints, the Kubernetes manifests render
(`kubectl kustomize`) and validate against the Kubernetes schemas offline, and every command,
flag, port and path that a Dockerfile, the compose file or a manifest names exists in the
project's CLIs, defaults and tree."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any, Callable

import kubernetes_validate
import pytest
import yaml
from yamllint import linter
from yamllint.config import YamlLintConfig

from cloud_server import cli as server_cli
from cloud_server.rpc import health_check
from cloud_server.rpc.server import GRACE_S
from edge_client import cli as edge_cli
from netsim import cli as netsim_cli
from shared.messages import Limits

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKERFILES = sorted((DEPLOY / "docker").glob("*.Dockerfile"))
OVERLAYS = {"base": DEPLOY / "k8s" / "base", "gpu": DEPLOY / "k8s" / "overlays" / "gpu",
            "gpu-tls": DEPLOY / "k8s" / "overlays" / "gpu-tls",
            "gpu-tp": DEPLOY / "k8s" / "overlays" / "gpu-tp"}
COMPOSE_FILES = sorted(DEPLOY.glob("compose*.yaml"))
PARSERS: dict[str, Callable[[list[str]], Any]] = {
    "cloud-server": server_cli.parse_args, "edge-client": edge_cli.parse_args,
    "netsim": netsim_cli.parse_args}
LINT = YamlLintConfig("extends: default\nrules: {line-length: {max: 100}, "
                      "document-start: disable, truthy: {check-keys: false}}")


def parse_command(argv: list[str]) -> tuple[str, Any]:
    """The program and its parsed arguments; fails the test if the CLI would refuse them."""
    program, *args = argv
    assert program in PARSERS, f"{program} is none of the project's commands"
    if program == "cloud-server" and args[:1] == ["health"]:
        return "cloud-server health", health_check.parse_args(args[1:])
    try:
        return program, PARSERS[program](args)
    except SystemExit as exit_:
        pytest.fail(f"{program} refuses {args} (exit {exit_.code})")


def test_the_project_scripts_are_the_commands_checked_here():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert set(scripts) == set(PARSERS)


@pytest.mark.parametrize("path", sorted(DEPLOY.rglob("*.yaml")), ids=lambda p: p.name)
def test_yaml_lints(path):
    problems = [f"{path.name}:{p.line}: {p.message}" for p in linter.run(path.read_text(), LINT)]
    assert not problems


# ---- Dockerfiles


def instructions(path: Path) -> list[tuple[str, str]]:
    text = path.read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1])
            for line in lines if line and not line.startswith("#")]


def exec_form(value: str) -> list[str]:
    argv = json.loads(value)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), value
    return argv


def dockerfile(path: Path) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for key, value in instructions(path):
        found.setdefault(key, []).append(value)
    return found


def image_command(path: Path) -> list[str]:
    found = dockerfile(path)
    return exec_form(found["ENTRYPOINT"][-1]) + exec_form(found["CMD"][-1])


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_names_what_exists(path):
    found = dockerfile(path)
    for copy in found["COPY"]:
        *sources, _ = copy.split()
        assert all((ROOT / s).exists() for s in sources), copy
    assert found["USER"][-1] not in ("0", "root"), "the image must not run as root"
    env = " ".join(found["ENV"])
    assert f"SPLITDEC_CACHE={found['VOLUME'][0]}" in env, "the cache must be the volume"
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for run in found["RUN"]:
        for extra in re.findall(r"'\.\[(\w+)\]'", run):
            assert extra in extras, run
        for package in re.findall(r"grep '\^([\w-]+)=='", run):
            assert f"{package}==" in (ROOT / "data-packages.txt").read_text(), run
    program, args = parse_command(image_command(path))
    exposed = int(found["EXPOSE"][0])
    if program == "cloud-server":
        assert args.port == exposed and args.host == "0.0.0.0"
        health = exec_form(found["HEALTHCHECK"][0].split("CMD", 1)[1].strip())
        name, check = parse_command(health)
        assert name == "cloud-server health" and check.server.endswith(f":{exposed}")
    else:
        assert args.command == "serve" and args.port == exposed and args.host == "0.0.0.0"


def test_the_images_run_the_device_they_are_named_for():
    devices = {p.name: parse_command(image_command(p))[1] for p in DOCKERFILES
               if p.name.startswith("server-")}
    assert devices["server-cpu.Dockerfile"].device == "cpu"
    assert devices["server-cuda.Dockerfile"].device == "cuda"


# ---- compose


def substituted(args: list[str]) -> list[str]:
    """${VAR:-default} as compose fills it with VAR unset."""
    return [re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", a) for a in args]


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_services_run_commands_that_exist_and_reach_each_other(path):
    compose = yaml.safe_load(path.read_text())
    services = compose["services"]
    built = {s["image"]: DEPLOY / s["build"]["context"] / s["build"]["dockerfile"]
             for s in services.values() if "build" in s}
    assert all(path.is_file() for path in built.values())
    parsed, listens = {}, {}
    for name, service in services.items():
        entrypoint = service.get("entrypoint") or exec_form(
            dockerfile(built[service["image"]])["ENTRYPOINT"][-1])
        program, args = parse_command(entrypoint + substituted(service["command"]))
        parsed[name] = (program, args)
        listens[name] = args.port if program == "cloud-server" else (
            int(args.listen.rsplit(":", 1)[1]) if program == "netsim" else None)
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert (source in compose["volumes"] if not source.startswith(".")
                    else (DEPLOY / source).exists()), volume
        for dependency in service.get("depends_on", {}):
            assert dependency in services
    for name, (program, args) in parsed.items():
        if program == "cloud-server":
            assert_gpus_fit_ranks(services[name], args)
        address = getattr(args, "target", None) or getattr(args, "server", None)
        if program in ("netsim", "edge-client"):
            host, port = address.rsplit(":", 1)
            assert listens.get(host) == int(port), f"{name} dials {address}: nobody listens"


def assert_gpus_fit_ranks(service: dict[str, Any], args: Any) -> None:
    """A server over N ranks reserves N GPUs and shared memory beyond a container's 64 MB."""
    devices = service.get("deploy", {}).get("resources", {}).get("reservations", {}).get(
        "devices", [])
    gpus = sum(d["count"] for d in devices if "gpu" in d["capabilities"])
    assert gpus == (args.tensor_parallel if args.device == "cuda" else 0)
    if args.tensor_parallel > 1:
        assert service.get("ipc") == "host" or service["shm_size"].endswith("gb")


# ---- Kubernetes


def rendered(overlay: str) -> list[dict[str, Any]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: the manifests cannot be rendered here")
    out = subprocess.run(["kubectl", "kustomize", str(OVERLAYS[overlay])], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


@pytest.mark.slow  # renders with kubectl: make test-all
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_manifests_validate_against_the_kubernetes_schemas(overlay):
    docs = rendered(overlay)
    assert {d["kind"] for d in docs} == {"Deployment", "Service", "PodDisruptionBudget"}
    version = kubernetes_validate.latest_version()
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.slow
@pytest.mark.parametrize("overlay", sorted(OVERLAYS))
def test_manifests_match_the_server(overlay):
    docs = rendered(overlay)
    pod = one(docs, "Deployment")["spec"]["template"]
    spec, labels = pod["spec"], pod["metadata"]["labels"]
    (container,) = spec["containers"]
    _, args = parse_command(["cloud-server", *container["args"]])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["grpc"] == args.port and args.host == "0.0.0.0"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    secrets = {v["name"] for v in spec["volumes"] if "secret" in v}

    def from_secret(path: str) -> bool:
        return mounts.get(str(Path(path).parent)) in secrets

    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if args.tls_cert is None:  # Kubernetes' gRPC probe, which speaks no TLS
            port, service = container[probe]["grpc"]["port"], container[probe]["grpc"].get(
                "service", "")
        else:
            name, check = parse_command(container[probe]["exec"]["command"])
            assert name == "cloud-server health" and from_secret(check.tls_ca)
            port, service = int(check.server.rsplit(":", 1)[1]), check.service
        assert port == args.port and service in ("", health_check.SERVICE_NAME)
    service = one(docs, "Service")
    assert service["spec"]["ports"][0]["targetPort"] in ports
    affinity = service["spec"]["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"]
    assert affinity >= Limits().session_idle_timeout_s, "a resume must find its replica"
    for selector in (service["spec"]["selector"],
                     one(docs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"]):
        assert selector.items() <= labels.items()
    assert spec["terminationGracePeriodSeconds"] > GRACE_S
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["SPLITDEC_CACHE"] in {m["mountPath"] for m in container["volumeMounts"]}
    assert spec["securityContext"]["runAsNonRoot"]
    assert from_secret(args.auth_token_file), "the token comes from a Secret"
    assert args.tls_cert is None or (from_secret(args.tls_cert) and from_secret(args.tls_key))
    assert (args.tls_cert is not None) == overlay.endswith("tls")
    image, tag = container["image"].split(":")
    assert args.device == tag == ("cuda" if overlay.startswith("gpu") else "cpu")
    assert any(f"-t {image}:{tag} ." in p.read_text() for p in DOCKERFILES), container["image"]
    assert ("nvidia.com/gpu" in container["resources"]["limits"]) == overlay.startswith("gpu")
    if args.tensor_parallel > 1:  # a GPU a rank, and their shared memory in RAM
        assert container["resources"]["limits"]["nvidia.com/gpu"] == args.tensor_parallel
        assert spec["volumes"][[v["name"] for v in spec["volumes"]].index(
            mounts["/dev/shm"])]["emptyDir"]["medium"] == "Memory"
        assert any(args.model.startswith(path + "/") for path in mounts), args.model
