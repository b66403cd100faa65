"""The deployment files agree with what the services accept (no Docker engine or cluster runs
here, so their structure is what can be checked): every flag a container passes exists in that
service's --help, and every address one service dials is one another service listens on."""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
SERVICES = ("verifier", "drafter", "gateway")


@functools.cache
def accepted_flags(module: str) -> str:
    return subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=True).stdout


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def check_commands(commands: dict[str, list[str]]) -> None:
    for service, args in commands.items():
        module, *flags = args
        assert module == f"pardec.{service}"
        for flag in (f for f in flags if f.startswith("--")):
            assert flag in accepted_flags(module), f"{service}: {flag} is not a flag of python -m {module}"


def test_compose_services_commands_ports_and_health_checks_agree():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    assert set(compose) == {"redis", *SERVICES}
    commands = {name: compose[name]["command"] for name in SERVICES}
    check_commands(commands)
    gateway = commands["gateway"]
    assert flag_value(gateway, "--verifier") == f"verifier:{port(flag_value(commands['verifier'], '--addr'))}"
    assert flag_value(gateway, "--drafter") == f"dns:///drafter:{port(flag_value(commands['drafter'], '--addr'))}"
    assert flag_value(commands["drafter"], "--redis-url").startswith("redis://redis:6379")
    assert f"{port(flag_value(gateway, '--addr'))}:{port(flag_value(gateway, '--addr'))}" in compose["gateway"]["ports"]
    for name in SERVICES:
        probe = compose[name]["healthcheck"]["test"]
        assert probe[1:4] == ["python", "-m", "pardec.runtime.health_probe"]
        assert port(probe[4]) == port(flag_value(commands[name], "--addr"))


def test_kubernetes_manifests_agree_with_the_services():
    documents = list(yaml.safe_load_all((DEPLOY / "k8s" / "pardec.yaml").read_text()))
    workloads = {d["metadata"]["name"]: d for d in documents if d["kind"] in ("Deployment", "StatefulSet")}
    services = {d["metadata"]["name"]: d for d in documents if d["kind"] == "Service"}
    assert workloads["pardec-drafter"]["kind"] == "Deployment"  # scales horizontally
    assert workloads["pardec-verifier"]["kind"] == "StatefulSet"
    assert services["pardec-drafter"]["spec"]["clusterIP"] == "None"  # DNS lists every replica
    commands = {name: workloads[f"pardec-{name}"]["spec"]["template"]["spec"]["containers"][0]["args"] for name in SERVICES}
    check_commands(commands)
    for name in SERVICES:
        listen = port(flag_value(commands[name], "--addr"))
        assert listen in [p["port"] for p in services[f"pardec-{name}"]["spec"]["ports"]]
        container = workloads[f"pardec-{name}"]["spec"]["template"]["spec"]["containers"][0]
        assert container["readinessProbe"]["grpc"]["port"] == listen
    gateway = commands["gateway"]
    assert flag_value(gateway, "--verifier") == "pardec-verifier:50053"
    assert flag_value(gateway, "--drafter") == "dns:///pardec-drafter:50052"
