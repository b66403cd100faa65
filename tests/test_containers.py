"""The images and deploy/compose.yaml for real: a Docker engine is found or installed (Debian's
docker.io, with Debian's docker-compose and debootstrap), started if it is not running, the
images are built once per run by deploy/build-images, and the compose stack serves a request
through the gateway's published ports, then leaves nothing behind. Then the same with mutual TLS
between the services (deploy/make-certs, deploy/compose.tls.yaml): drafting works across the TLS
hops, and plaintext or another certificate is refused inside the compose network.

Skipped, with the reason, where the engine cannot be installed or started (not root, no apt-get,
no registry for Debian's packages, no cgroups or overlay filesystem). PARDEC_CONTAINER_TESTS=0
skips them on purpose. What the run builds (its images, the base it made, the wheels) is removed
at its end, and a dockerd it started is stopped.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
TAG = f"test{os.getpid()}"
PROJECT = f"pardectest{os.getpid()}"
BASE = "pardec-debian:bookworm"  # the base build-images makes where no registry gives one
PACKAGES = {"dockerd": "docker.io", "docker-compose": "docker-compose", "debootstrap": "debootstrap"}

pytestmark = pytest.mark.skipif(os.environ.get("PARDEC_CONTAINER_TESTS") == "0",
                                reason="PARDEC_CONTAINER_TESTS=0")


def run(*args: str, timeout: float = 300, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=check, **kwargs)


def engine_answers() -> bool:
    return shutil.which("docker") is not None and run("docker", "info", check=False, timeout=30).returncode == 0


def install_missing() -> str | None:
    """Why the engine's packages are not there and cannot be installed, or None once they are."""
    missing = sorted({package for tool, package in PACKAGES.items() if shutil.which(tool) is None})
    if not missing:
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return f"{', '.join(missing)} missing, and installing them needs root and apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *missing]):
        result = run(*command, check=False, timeout=600, env=env)
        if result.returncode != 0:
            return f"{' '.join(command)} failed: {result.stderr[-500:]}"
    return None


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    reason = install_missing()
    if reason:
        pytest.skip(f"no Docker engine: {reason}")
    daemon = None
    if not engine_answers():
        log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
        with open(log, "w") as sink:
            daemon = subprocess.Popen(["dockerd"], stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while not engine_answers():
            if daemon.poll() is not None or time.monotonic() > deadline:
                daemon.terminate()
                daemon.wait(30)
                pytest.skip(f"dockerd did not start here: {log.read_text()[-800:]}")
            time.sleep(1)
    had_base = run("docker", "image", "inspect", BASE, check=False).returncode == 0
    yield
    if not had_base:
        run("docker", "image", "rm", BASE, check=False)
    if daemon is not None:
        daemon.terminate()
        daemon.wait(60)


@pytest.fixture(scope="session")
def images(engine, tmp_path_factory):
    """pardec:TAG and pardec-redis:TAG, built once; the password file compose's secret reads."""
    work = tmp_path_factory.mktemp("images")
    env = {**os.environ, "PARDEC_IMAGE_TAG": TAG, "PARDEC_WHEELHOUSE": str(work / "wheelhouse"),
           "PARDEC_REDIS_PASSWORD_FILE": str(work / "secrets" / "redis-password")}
    start = time.monotonic()
    built = run(str(REPO / "deploy" / "build-images"), check=False, timeout=1200, env=env)
    print(f"deploy/build-images: {time.monotonic() - start:.0f}s\n{built.stderr[-2000:]}")
    try:
        assert built.returncode == 0, built.stderr[-3000:]
        yield env
    finally:
        run("docker", "image", "rm", "-f", f"pardec:{TAG}", f"pardec-redis:{TAG}", check=False)
        # Layers of failed or replaced builds that no tag holds any longer.
        run("docker", "image", "prune", "-f", check=False)
        shutil.rmtree(work, ignore_errors=True)


def test_dockerd_runs_a_container(engine):
    base = BASE if run("docker", "image", "inspect", BASE, check=False).returncode == 0 else None
    if base is None:  # the premise needs an image; build-images' first step makes this one
        made = run(str(REPO / "deploy" / "build-images"), check=False, timeout=900,
                   env={**os.environ, "PARDEC_BASE_ONLY": "1"})
        assert made.returncode == 0, made.stderr[-2000:]
        base = BASE
    result = run("docker", "run", "--rm", base, "cat", "/etc/debian_version")
    assert result.stdout.strip().startswith("12.")


def test_image_runs_unprivileged_with_weights_and_kernels_prepared(images):
    image = f"pardec:{TAG}"
    shown = run("docker", "run", "--rm", "--entrypoint", "sh", image, "-c",
                "id -u && python --version && ls ~/.cache/pardec").stdout.split()
    assert shown[0] != "0"
    assert shown[1:3] == ["Python", shown[2]] and shown[2].startswith("3.11.")
    assert any(name.endswith(".safetensors") for name in shown)
    assert any(name.startswith(("int8_linear-", "tree_attention-")) for name in shown)
    health = json.loads(run("docker", "image", "inspect", "--format", "{{json .Config.Healthcheck}}", image).stdout)
    assert "pardec.runtime.health_probe" in " ".join(health["Test"])


def compose_file(directory: Path) -> Path:
    """deploy/compose.yaml with the gateway's ports published on loopback at free host ports."""
    compose = yaml.safe_load((REPO / "deploy" / "compose.yaml").read_text())
    compose["services"]["gateway"]["ports"] = [f"127.0.0.1::{p.rsplit(':', 1)[1]}"
                                               for p in compose["services"]["gateway"]["ports"]]
    path = directory / "compose.yaml"
    path.write_text(yaml.safe_dump(compose, sort_keys=False))
    return path


def post(url: str, body: dict | None = None, timeout: float = 120) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


def wait_for_http(stack: Stack, limit_s: float = 300) -> None:
    """`up -d` returns once the gateway's container has started, not once it listens: until then
    the engine's proxy on the published port accepts and closes."""
    deadline = time.monotonic() + limit_s
    while True:
        try:
            post(f"http://{stack.port(8000)}/v1/models", timeout=10)
            return
        except (OSError, http.client.HTTPException):
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def left_behind(project: str = PROJECT) -> list[str]:
    label = f"label=com.docker.compose.project={project}"
    return [line for kind in (["ps", "-a"], ["network", "ls"], ["volume", "ls"])
            for line in run("docker", *kind, "-q", "--filter", label).stdout.split()]


class Stack:
    """A compose project of deploy/compose.yaml (and overrides), its ports published on loopback."""

    def __init__(self, directory: Path, env: dict, project: str = PROJECT, overrides: tuple[Path, ...] = ()):
        self.env = env
        self.project = project
        self.command = ["docker-compose", "-p", project, "-f", str(compose_file(directory)),
                        *(arg for override in overrides for arg in ("-f", str(override)))]

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        return run(*self.command, *args, timeout=timeout, check=check, env=self.env)

    def port(self, container_port: int) -> str:
        return self("port", "gateway", str(container_port)).stdout.strip()

    def containers(self, service: str) -> list[str]:
        return self("ps", "-q", service).stdout.split()


@pytest.fixture(scope="module")
def stack(images, tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("compose"), images)
    start = time.monotonic()
    up = stack("up", "-d", check=False, timeout=900)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        wait_for_http(stack)
        print(f"up -d, HTTP answering: {time.monotonic() - start:.0f}s")
        yield stack
    finally:
        stack("down", "-v", "--remove-orphans", check=False)


MESSAGES = [{"role": "user", "content": "Name three colors."}]


def test_compose_up_serves_through_the_published_ports(stack):
    from pardec.client import Client

    http = stack.port(8000)
    model = post(f"http://{http}/v1/models")["data"][0]["id"]
    reply = post(f"http://{http}/v1/chat/completions",
                 {"model": model, "messages": MESSAGES, "max_tokens": 24, "temperature": 0})
    text = reply["choices"][0]["message"]["content"]
    assert text.strip()
    assert reply["usage"]["pardec"]["draft_tokens"] > 0  # the drafter took part, through Redis
    with Client(stack.port(50051), timeout=120) as client:
        assert client.chat(MESSAGES, max_new_tokens=24, temperature=0, plain=True).text == text


def propose_count(container: str) -> float:
    """pardec_drafter_requests_total of Propose, read inside the replica (its port is not published)."""
    metrics = run("docker", "exec", container, "python", "-c",
                  "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9465/metrics').read().decode())")
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.stdout.splitlines()
               if line.startswith("pardec_drafter_requests_total{") and "Propose" in line)


def test_scaled_drafters_all_serve_propose(stack):
    scaled = stack("up", "-d", "--no-recreate", "--scale", "drafter=3", check=False, timeout=600)
    assert scaled.returncode == 0, scaled.stderr[-3000:]
    replicas = stack.containers("drafter")
    assert len(replicas) == 3
    before = {replica: propose_count(replica) for replica in replicas}
    http, deadline = stack.port(8000), time.monotonic() + 90
    model = post(f"http://{http}/v1/models")["data"][0]["id"]
    rising: set[str] = set()
    while len(rising) < 3 and time.monotonic() < deadline:
        for n in range(3):
            post(f"http://{http}/v1/chat/completions",
                 {"model": model, "max_tokens": 16, "temperature": 0,
                  "messages": [{"role": "user", "content": f"Count from {n} to {n + 5}."}]})
        rising = {replica for replica in replicas if propose_count(replica) > before[replica]}
    assert rising == set(replicas), f"no Propose reached {sorted(set(replicas) - rising)} of {before}"


def test_a_drafter_killed_mid_stream_leaves_the_output_of_plain_decoding(stack):
    from pardec.client import Client

    prompt = "Write a short story about a robot who learns to paint."
    with Client(stack.port(50051), timeout=300) as client:
        plain = client.generate(prompt, max_new_tokens=96, temperature=0, plain=True).text
        chunks = []
        for chunk in client.stream(prompt, max_new_tokens=96, temperature=0):
            chunks.append(chunk.text)
            if len(chunks) == 3:  # drafting is under way: take the first replica away
                run("docker", "kill", f"{PROJECT}_drafter_1")
    assert "".join(chunks) == plain


def test_compose_down_leaves_nothing(stack):
    down = stack("down", "-v", "--remove-orphans", check=False)
    assert down.returncode == 0, down.stderr[-3000:]
    assert left_behind() == []


# Mutual TLS (deploy/make-certs + deploy/compose.tls.yaml): a project of its own, up once the plain
# one is down, so the two never hold the two cores at once.
TLS_PROJECT = f"{PROJECT}tls"

# Run inside the compose network: what a container without the right certificate gets.
PLAINTEXT_PROBES = """
import subprocess, sys
probe = [sys.executable, "-m", "pardec.runtime.health_probe"]
tls = ["--tls-ca", "/run/secrets/ca-cert", "--tls-cert", "/run/secrets/gateway-cert",
       "--tls-key", "/run/secrets/gateway-key"]
for address in ("verifier:50053", "drafter:50052"):
    plain = subprocess.run(probe + [address], capture_output=True, text=True)
    mutual = subprocess.run(probe + [address] + tls, capture_output=True, text=True)
    print(address, plain.returncode, mutual.returncode, plain.stderr.strip()[:200])
"""
OTHER_CERTIFICATE = """
import grpc
from pardec.runtime.security import client_tls, open_channel
from pardec.v1 import drafter_pb2, drafter_pb2_grpc
tls = client_tls("/run/secrets/ca-cert", "/run/secrets/verifier-cert", "/run/secrets/verifier-key")
with open_channel("drafter:50052", tls) as channel:
    try:
        drafter_pb2_grpc.DrafterStub(channel).StartSession(
            drafter_pb2.StartSessionRequest(session_id="tls-probe", prompt_token_ids=[1, 2, 3]), timeout=10)
        print("OK")
    except grpc.RpcError as error:
        print(error.code().name)
"""
REDIS_PROBES = """
import redis
password = open("/run/secrets/redis-password").read().strip()
tls = dict(ssl=True, ssl_ca_certs="/run/secrets/ca-cert", ssl_certfile="/run/secrets/drafter-cert",
           ssl_keyfile="/run/secrets/drafter-key")
for port, extra in ((6380, {}), (6379, {}), (6380, tls)):
    try:
        redis.Redis(host="redis", port=port, password=password, socket_timeout=5, **extra).ping()
        print(port, bool(extra), "answered")
    except redis.exceptions.RedisError as error:
        print(port, bool(extra), "refused", type(error).__name__)
"""


@pytest.fixture(scope="module")
def tls_stack(images, tmp_path_factory):
    env = {**images, "PARDEC_SECRETS_DIR": str(tmp_path_factory.mktemp("tls") / "secrets")}
    made = run(str(REPO / "deploy" / "make-certs"), check=False, env=env)
    assert made.returncode == 0, made.stderr[-2000:]
    stack = Stack(tmp_path_factory.mktemp("compose-tls"), env, TLS_PROJECT,
                  (REPO / "deploy" / "compose.tls.yaml",))
    start = time.monotonic()
    up = stack("up", "-d", check=False, timeout=900)
    try:
        assert up.returncode == 0, up.stderr[-3000:] + stack("logs", "--tail", "30", check=False).stdout[-3000:]
        wait_for_http(stack)
        print(f"up -d (mutual TLS), HTTP answering: {time.monotonic() - start:.0f}s")
        yield stack
    finally:
        stack("down", "-v", "--remove-orphans", check=False)


def test_mutual_tls_stack_drafts_through_tls_hops(tls_stack):
    http = tls_stack.port(8000)
    model = post(f"http://{http}/v1/models")["data"][0]["id"]
    reply = post(f"http://{http}/v1/chat/completions",
                 {"model": model, "messages": MESSAGES, "max_tokens": 24, "temperature": 0})
    assert reply["choices"][0]["message"]["content"].strip()
    # Drafts need gateway -> drafter (mutual TLS) and drafter -> Redis (rediss://) both working.
    assert reply["usage"]["pardec"]["draft_tokens"] > 0


def test_mutual_tls_stack_refuses_plaintext_and_other_certificates(tls_stack):
    probes = tls_stack("exec", "-T", "gateway", "python", "-c", PLAINTEXT_PROBES).stdout
    print(probes)
    codes = {line.split()[0]: line.split()[1:3] for line in probes.splitlines()}
    # Without TLS the probe fails (1); with the gateway's certificate the same port answers (0).
    assert codes == {"verifier:50053": ["1", "0"], "drafter:50052": ["1", "0"]}
    other = tls_stack("exec", "-T", "verifier", "python", "-c", OTHER_CERTIFICATE).stdout.strip()
    assert other == "PERMISSION_DENIED"  # a certificate of the same CA, but not the gateway's
    redis_probes = tls_stack("exec", "-T", "drafter", "python", "-c", REDIS_PROBES).stdout
    print(redis_probes)
    answers = [line.split()[2] for line in redis_probes.splitlines()]
    assert answers == ["refused", "refused", "answered"]  # plaintext, with the password, is refused


def test_mutual_tls_stack_down_leaves_nothing(tls_stack):
    down = tls_stack("down", "-v", "--remove-orphans", check=False)
    assert down.returncode == 0, down.stderr[-3000:]
    assert left_behind(TLS_PROJECT) == []
