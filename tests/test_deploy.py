"""Deployment artifacts: the Dockerfile, config/docker.yaml and the Kubernetes sidecar example in config/kubernetes.

Manifests are validated against the Kubernetes schemas; the image's ENTRYPOINT/CMD and HEALTHCHECK run for real.
"""

from __future__ import annotations

import contextlib
import http.server
import io
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from proxy.cli import flag_overrides, main, parse_args
from proxy.config.loader import load_config
from proxy.config.schema import Config, HttpUpstreamConfig
from proxy.edge._admission import host_allowed
from tests.support.processes import ROOT, Upstream, free_port
from tests.support.waiting import until_sync

KUBERNETES_VERSION = "1.30"  # the oldest minor the example supports
KUBE_DIR = ROOT / "config" / "kubernetes"
DOCKER_CONFIG = ROOT / "config" / "docker.yaml"
LOOPBACK_HOSTS = {"localhost", "127.0.0.1"}


# --- Dockerfile --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    stage: int  # 0 for the first FROM's stage, 1 for the next, ...


def _dockerfile() -> list[Instruction]:
    """Instructions in order: comments and blank lines dropped, `\\` continuations joined."""
    instructions: list[Instruction] = []
    stage = -1
    pending = ""
    for raw in (ROOT / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # also inside a continuation, as Docker does
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        keyword, _, args = (pending + line).partition(" ")
        pending = ""
        if keyword.upper() == "FROM":
            stage += 1
        instructions.append(Instruction(keyword.upper(), args.strip(), stage))
    assert not pending, "the Dockerfile ends inside a line continuation"
    return instructions


def _final(keyword: str) -> list[Instruction]:
    instructions = _dockerfile()
    last_stage = instructions[-1].stage
    return [i for i in instructions if i.keyword == keyword and i.stage == last_stage]


def _exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list), f"not exec form: {args}"
    assert all(isinstance(item, str) for item in value), args
    return value


def _one(keyword: str) -> str:
    found = _final(keyword)
    assert len(found) == 1, f"expected one {keyword} in the final stage, got {found}"
    return found[0].args


def _healthcheck() -> list[str]:
    match = re.fullmatch(r"((?:--\S+\s+)*)CMD\s+(.*)", _one("HEALTHCHECK"))
    assert match, "HEALTHCHECK must be `HEALTHCHECK [OPTIONS] CMD [...]`"
    return _exec_form(match.group(2))


def _copies() -> list[tuple[int, list[str], list[str], str]]:
    """(stage, flags, sources, destination) of every COPY."""
    copies = []
    for instruction in _dockerfile():
        if instruction.keyword != "COPY":
            continue
        tokens = shlex.split(instruction.args)
        flags = [token for token in tokens if token.startswith("--")]
        rest = [token for token in tokens if not token.startswith("--")]
        if rest and rest[0].startswith("["):
            rest = _exec_form(" ".join(rest))
        assert len(rest) >= 2, instruction
        copies.append((instruction.stage, flags, rest[:-1], rest[-1]))
    return copies


def _image_user() -> int:
    user = _one("USER")
    assert user.isdigit(), f"USER {user}: use a numeric UID so runAsNonRoot can verify it"
    return int(user)


def _dockerignore() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = str(PurePosixPath(line.lstrip("!").strip("/")))
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex, i = regex + pattern[i : end + 1], end + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((negate, re.compile(regex)))
    return rules


def _ignored(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Whether the build context leaves `path` out (a path is out when it or a parent matches; last rule wins)."""
    parts = PurePosixPath(path).parts
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for negate, regex in rules:
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            ignored = not negate
    return ignored


def test_dockerfile_builds_both_stages_on_the_slim_python_users_pull_unless_told_otherwise() -> None:
    """`make image-test` builds and runs the image on a local base (the BASE build argument); a plain
    `docker build .` still gets python:3.N-slim, the same for both stages (the venv links to its interpreter)."""
    globals_ = dict(i.args.split("=", 1) for i in _dockerfile() if i.keyword == "ARG" and i.stage == -1)
    assert re.fullmatch(r"python:3\.\d+-slim", globals_.get("BASE", "")), globals_
    assert [i.args.split()[0] for i in _dockerfile() if i.keyword == "FROM"] == ["${BASE}", "${BASE}"]


def test_dockerfile_runs_as_a_non_root_system_user_owning_the_volume() -> None:
    uid = _image_user()
    assert uid != 0
    volume = _one("VOLUME")
    volumes = _exec_form(volume) if volume.startswith("[") else volume.split()
    assert volumes == ["/var/lib/mcp-tasks-proxy"]
    before_volume = _dockerfile()[: _dockerfile().index(_final("VOLUME")[0])]
    runs = [i.args for i in before_volume if i.keyword == "RUN" and i.stage == 1]
    assert any(f"--uid {uid}" in run and "--no-create-home" in run and "nologin" in run for run in runs), runs
    assert any(str(uid) in run and volumes[0] in run for run in runs), "the volume directory must belong to USER"
    assert load_config(DOCKER_CONFIG, environ={}).store.path.startswith(volumes[0] + "/")


def test_every_copy_source_exists_and_is_in_the_build_context() -> None:
    rules = _dockerignore()
    for _, flags, sources, _ in _copies():
        if any(flag.startswith("--from=") for flag in flags):
            continue
        for source in sources:
            path = ROOT / source
            assert path.exists(), f"COPY {source}: not in the repository"
            files = [path] if path.is_file() else [p for p in path.rglob("*.py") if "__pycache__" not in p.parts]
            assert files, source
            for file in files:
                relative = file.relative_to(ROOT).as_posix()
                assert not _ignored(relative, rules), f"COPY {source}: .dockerignore leaves {relative} out"


def test_dockerignore_keeps_environments_caches_databases_and_tests_out() -> None:
    rules = _dockerignore()
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        ".mypy_cache/x.json",
        "proxy/__pycache__/cli.cpython-312.pyc",
        "conformance/node_modules/x/index.js",
        "conformance/out/report.json",
        "tasks.db",
        "data/tasks.db-wal",
        "tasks.db-shm",
        "tasks.db.lock",
        "tasks.db.key",  # the deployment key kept beside a database: a secret
        "data/tasks.db-journal",
        ".run/mcp-tasks-proxy.db",  # make run's state
        ".run/mcp-tasks-proxy.db.key",
        "tests/test_app.py",
    ):
        assert _ignored(path, rules), f"{path} would be sent to the Docker daemon"
    for path in ("pyproject.toml", "README.md", "proxy/cli.py", "config/docker.yaml"):
        assert not _ignored(path, rules), path


def test_docker_config_is_valid_and_fits_a_sidecar(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(DOCKER_CONFIG)]) == 0
    assert "ok" in capsys.readouterr().out
    config = load_config(DOCKER_CONFIG, environ={})
    assert (config.listen.host, config.listen.port, config.listen.path) == ("0.0.0.0", 8080, "/mcp")
    assert isinstance(config.upstream, HttpUpstreamConfig)
    assert config.upstream.url == "http://127.0.0.1:9000/mcp"
    assert config.store.path == "/var/lib/mcp-tasks-proxy/tasks.db"
    assert config.logging.format == "json"


# --- the image's commands, run from the installed console script ------------------------------------------


def _script() -> Path:
    script = Path(sys.executable).parent / "mcp-tasks-proxy"
    assert script.exists(), f"{script} missing: install the project (pip install -e .)"
    return script


def _in_repo(argv: list[str]) -> list[str]:
    """The image's command with the console script and the files the Dockerfile COPYs mapped to the repo."""
    copied = {dest: ROOT / sources[0] for stage, flags, sources, dest in _copies() if stage == 1 and not flags}
    assert argv[0] == "mcp-tasks-proxy", argv
    return [str(_script()), *(str(copied.get(arg, arg)) for arg in argv[1:])]


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str) -> tuple[int, str]:
    try:
        with _DIRECT.open(url, timeout=2) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _probe_available() -> bool:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(["probe", "--help"])
        except SystemExit as stop:
            return stop.code == 0
    return False


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    port: int
    log: Path

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


@pytest.fixture
def served(upstream: Upstream, tmp_path: Path) -> Iterator[Served]:
    """The image's ENTRYPOINT + CMD on the repo's config/docker.yaml, with what a container provides overridden."""
    port = free_port()
    environ = {key: value for key, value in os.environ.items() if not key.startswith("MCP_TASKS_PROXY_")}
    environ.update(
        MCP_TASKS_PROXY_LISTEN__HOST="127.0.0.1",
        MCP_TASKS_PROXY_LISTEN__PORT=str(port),
        MCP_TASKS_PROXY_OBSERVABILITY__HOST="127.0.0.1",
        MCP_TASKS_PROXY_OBSERVABILITY__PORT="0",
        MCP_TASKS_PROXY_STORE__PATH=str(tmp_path / "tasks.db"),
        MCP_TASKS_PROXY_UPSTREAM__URL=upstream.url,
    )
    argv = _in_repo(_exec_form(_one("ENTRYPOINT")) + _exec_form(_one("CMD")))
    log = tmp_path / "proxy.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(argv, cwd=tmp_path, env=environ, stdout=sink, stderr=subprocess.STDOUT)
    server = Served(process, port, log)
    try:

        def answers() -> bool:
            assert process.poll() is None, f"the proxy exited with {process.returncode}:\n{server.output()}"
            try:
                _get(server.url("/healthz"))
            except OSError:
                return False
            return True

        until_sync(answers, lambda: f"the proxy did not answer:\n{server.output()}", 15)
        yield server
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_image_command_serves_readyz_and_stops_cleanly_on_sigterm(served: Served) -> None:
    assert _get(served.url("/healthz"))[0] == 200, served.output()
    last: list[Any] = []

    def ready() -> bool:
        last[:] = _get(served.url("/readyz"))
        return bool(last[0] == 200)

    until_sync(ready, lambda: f"/readyz: {last}\n{served.output()}")
    served.process.send_signal(signal.SIGTERM)
    try:
        code = served.process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the proxy did not exit within 30 s of SIGTERM:\n{served.output()}")
    assert code == 0, served.output()


def test_healthcheck_command_passes_on_a_serving_proxy_and_fails_on_a_stopped_one(served: Served) -> None:
    if not _probe_available():
        pytest.skip("`mcp-tasks-proxy probe` does not exist yet: the Dockerfile's HEALTHCHECK cannot be run")
    command = _healthcheck()
    url = urlsplit(command[2])
    argv = _in_repo([*command[:2], urlunsplit(url._replace(netloc=f"{url.hostname}:{served.port}")), *command[3:]])
    healthy = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert healthy.returncode == 0, f"{healthy.stdout}{healthy.stderr}\n{served.output()}"
    served.process.terminate()
    served.process.wait(timeout=30)
    stopped = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    assert stopped.returncode == 1, f"{stopped.stdout}{stopped.stderr}"


# --- Kubernetes --------------------------------------------------------------------------------------------

MANIFESTS = sorted(path.name for path in KUBE_DIR.glob("*.yaml") if path.name != "kustomization.yaml")


def _load(name: str) -> dict[str, Any]:
    documents = [doc for doc in yaml.safe_load_all((KUBE_DIR / name).read_text()) if doc is not None]
    assert len(documents) == 1, f"{name}: one object per file, found {len(documents)}"
    document = documents[0]
    assert isinstance(document, dict), name
    return document


def _by_kind(kind: str) -> dict[str, Any]:
    found = [document for document in map(_load, MANIFESTS) if document["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _proxy_container() -> dict[str, Any]:
    containers = _by_kind("Deployment")["spec"]["template"]["spec"]["containers"]
    found = [c for c in containers if c["image"].rsplit("/", 1)[-1].startswith("mcp-tasks-proxy:")]
    assert len(found) == 1, containers
    container: dict[str, Any] = found[0]
    return container


def _config_arg() -> PurePosixPath:
    args = _proxy_container()["args"]
    assert args[:2] == ["serve", "--config"], args
    return PurePosixPath(args[2])


KEY_FILE = "/var/run/secrets/mcp-tasks-proxy/key"


def _configmap_file(tmp_path: Path) -> Path:
    """The ConfigMap's entry the proxy reads (the key named by the --config file), written out as a file; the
    deployment key it names (a Secret mounted in the pod) is a file of the test's."""
    key = tmp_path / "key"
    key.write_text("k" * 64)
    path = tmp_path / _config_arg().name
    path.write_text(_by_kind("ConfigMap")["data"][_config_arg().name].replace(KEY_FILE, str(key)))
    return path


def test_the_deployment_key_comes_from_a_secret_mounted_read_only() -> None:
    assert KEY_FILE in _by_kind("ConfigMap")["data"][_config_arg().name]
    mounted = _mounts()[str(Path(KEY_FILE).parent)]
    assert mounted["readOnly"] is True
    assert mounted["secret"]["secretName"]


def _port(name: str) -> dict[str, Any]:
    """The proxy container's port of that name (`mcp`, `ops`)."""
    ports: list[dict[str, Any]] = _proxy_container()["ports"]
    (port,) = [port for port in ports if port["name"] == name]
    return port


def _proxy_config(tmp_path: Path) -> Config:
    return load_config(_configmap_file(tmp_path), environ={})


# --- Kubernetes: the steps of the Kubernetes guide (docs/guides/kubernetes.md) ---------------------------------


def _kustomization(directory: Path) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((directory / "kustomization.yaml").read_text())
    return document


def _rendered_image(image: str, images: list[dict[str, str]]) -> str:
    """An image reference as kustomize's `images:` rewrites it (name matched without its tag)."""
    name, _, tag = image.partition(":")
    for entry in images:
        if entry["name"] == name:
            return f"{entry.get('newName', name)}:{entry.get('newTag', tag)}"
    return image


def _with_images(document: dict[str, Any], images: list[dict[str, str]]) -> dict[str, Any]:
    if document["kind"] != "Deployment":
        return document
    rendered = json.loads(json.dumps(document))
    for container in rendered["spec"]["template"]["spec"]["containers"]:
        container["image"] = _rendered_image(container["image"], images)
    return dict(rendered)


@pytest.mark.parametrize("directory", [KUBE_DIR, KUBE_DIR / "replicated"], ids=["single", "replicated"])
def test_the_kustomization_sets_every_image_the_deployment_names(directory: Path) -> None:
    """The images are values the user sets in one place (`images:`), each a registry path with a tag."""
    images = _kustomization(directory)["images"]
    deployment = next(
        document
        for path in sorted(directory.glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
        if document is not None and document.get("kind") == "Deployment"
    )
    containers = deployment["spec"]["template"]["spec"]["containers"]
    named = {container["image"].partition(":")[0] for container in containers}
    assert named == {entry["name"] for entry in images}
    for entry in images:
        assert "/" in entry["newName"], entry  # a registry the cluster pulls from, not a local name
        assert entry["newTag"], entry


KUBERNETES_GUIDE = ROOT / "docs" / "guides" / "kubernetes.md"


def _kubernetes_guide() -> str:
    """The Kubernetes guide up to its section on building and testing the image: the recipes and the steps."""
    text = KUBERNETES_GUIDE.read_text()
    assert text.startswith("# Container image and Kubernetes\n"), "the guide's title moved"
    return text[: text.index("\n## Building and testing the image\n")]


def _shell_lines(block: str) -> list[str]:
    """The commands of a shell block: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]


def _kubernetes_steps() -> list[str]:
    section = _kubernetes_guide()
    steps = section[section.index("To deploy (single replica):") :]
    blocks = re.findall(r"```sh\n(.*?)```", steps, re.DOTALL)
    return [line for block in blocks for line in _shell_lines(block)]


def test_the_guides_steps_create_the_secret_the_pod_mounts_with_the_key_the_config_reads() -> None:
    mounted = _mounts()[str(Path(KEY_FILE).parent)]
    secret, key = mounted["secret"]["secretName"], Path(KEY_FILE).name
    creating = [line for line in _kubernetes_steps() if line.startswith("kubectl create secret generic")]
    assert creating, "no step creates the key Secret"
    words = shlex.split(creating[0])
    assert words[4] == secret
    assert any(word.startswith(f"--from-literal={key}=") for word in words), words
    section = _kubernetes_guide()
    steps = section[section.index("To deploy (single replica):") :]
    assert steps.index(creating[0].split(" --from")[0]) < steps.index("kubectl apply -k"), "the Secret comes first"


def test_the_configmap_checks_on_a_machine_without_its_secret_and_strict_asks_for_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / _config_arg().name
    path.write_text(_by_kind("ConfigMap")["data"][_config_arg().name])  # as it is: the key file is not here
    assert main(["check-config", str(path)]) == 0
    assert f"security.key_file: read at start: file {KEY_FILE} not found here" in capsys.readouterr().err
    assert main(["check-config", "--strict", str(path)]) == 2


def _port_forward_request() -> tuple[str, str, dict[str, str], str]:
    """The guide's port-forward check: (the port-forward command, the URL, the headers, the body) of its
    curl, with `$TOKEN` as the step before it sets it."""
    lines = _kubernetes_steps()
    forward = next(line for line in lines if line.startswith("kubectl port-forward"))
    token_line = next(line for line in lines if line.startswith("TOKEN="))
    assert "openssl rand -hex 32" in token_line
    curl = shlex.split(next(line for line in lines if line.startswith("curl ")))
    url = next(word for word in curl if word.startswith("http"))
    headers: dict[str, str] = {}
    body = ""
    for flag, value in itertools.pairwise(curl):
        if flag == "-H":
            name, _, field = value.partition(":")
            headers[name.strip()] = field.strip().replace("$TOKEN", "0123456789abcdef" * 4)
        elif flag == "-d":
            body = value
    return forward, url, headers, body


async def test_the_guides_port_forward_request_is_served_by_the_configmaps_proxy(
    tmp_path: Path, upstream: Upstream
) -> None:
    """The request the guide sends through `kubectl port-forward` passes the ConfigMap's host check and its
    `anonymous: refuse`, and gets discover's answer; the same request without its token gets 401."""
    from aiohttp.test_utils import TestClient, TestServer

    from proxy.edge.app import create_app

    forward, url, headers, body = _port_forward_request()
    target, ports = shlex.split(forward)[2:4]
    local, _, remote = ports.partition(":")
    assert target == f"deployment/{_by_kind('Deployment')['metadata']['name']}"
    assert int(remote) == next(port["containerPort"] for port in _proxy_container()["ports"])
    parts = urlsplit(url)
    assert parts.port == int(local)
    configured = _proxy_config(tmp_path)
    assert parts.path == configured.listen.path
    # The ConfigMap's config as the pod runs it, but for where its upstream and database are on this machine.
    config = load_config(
        _configmap_file(tmp_path),
        environ={},
        overrides={"upstream": {"url": upstream.url}, "store": {"path": str(tmp_path / "tasks.db")}},
    )
    assert config.security == configured.security
    client = TestClient(TestServer(create_app(config), host="127.0.0.1"))
    await client.start_server()
    try:
        sent = {**headers, "Host": parts.netloc}  # curl's Host through the port-forward
        answer = await client.post(parts.path, data=body, headers=sent)
        assert answer.status == 200, await answer.text()
        assert "result" in json.loads(await answer.text())
        anonymous = {name: value for name, value in sent.items() if name.lower() != "authorization"}
        refused = await client.post(parts.path, data=body, headers=anonymous)
        assert refused.status == 401
        assert "WWW-Authenticate" in refused.headers
    finally:
        await client.close()


def _container_recipe() -> list[str]:
    """The words of the guide's `podman run` recipe against a server on the host."""
    section = _kubernetes_guide()
    blocks = re.findall(r"```sh\n(.*?)```", section, re.DOTALL)
    line = next(line for block in blocks for line in _shell_lines(block) if line.startswith("podman run"))
    return shlex.split(line)


def test_the_guides_container_recipe_serves_the_published_port_and_reaches_the_host(tmp_path: Path) -> None:
    words = _container_recipe()
    published = words[words.index("-p") + 1]
    host_address, host_port, container_port = published.split(":")
    image_at = next(index for index, word in enumerate(words) if word.startswith("mcp-tasks-proxy:"))
    args = parse_args(words[image_at + 1 :])
    assert args.command == "serve"
    assert args.config == "/etc/mcp-tasks-proxy/proxy.yaml"
    assert urlsplit(args.upstream).hostname == "host.containers.internal"  # podman's name for the host
    # The image's config file with what serve merges over it, where the image has it (config/docker.yaml).
    config = load_config(DOCKER_CONFIG, environ={}, overrides=flag_overrides(args))
    assert config.listen.host == "0.0.0.0"  # a published port reaches nothing on the container's loopback
    assert config.listen.port == int(container_port)
    assert config.upstream == HttpUpstreamConfig(url=args.upstream)
    assert host_allowed(f"{host_address}:{host_port}", config.security.allowed_hosts)  # curl on the host
    assert not host_allowed("mcp.example.com:8080", config.security.allowed_hosts)  # other names: 403 until added
    volume = words[words.index("-v") + 1]
    assert volume.split(":")[1] == str(Path(config.store.path).parent)  # the tasks outlive the container


def _mounts() -> dict[str, dict[str, Any]]:
    """mountPath → the pod volume mounted there."""
    volumes = {v["name"]: v for v in _by_kind("Deployment")["spec"]["template"]["spec"]["volumes"]}
    return {
        m["mountPath"]: {**volumes[m["name"]], "readOnly": m.get("readOnly", False)}
        for m in _proxy_container()["volumeMounts"]
    }


def test_the_example_has_each_object_once() -> None:
    kinds = sorted(_load(name)["kind"] for name in MANIFESTS)
    assert kinds == ["ConfigMap", "Deployment", "PersistentVolumeClaim", "Service"]


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_is_a_valid_kubernetes_object(name: str) -> None:
    document = _load(name)
    assert kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_kustomization_lists_exactly_the_manifests() -> None:
    kustomization = yaml.safe_load((KUBE_DIR / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert sorted(resources) == MANIFESTS
    assert len(set(resources)) == len(resources)


def test_deployment_is_a_single_writer_with_its_config_and_claim(tmp_path: Path) -> None:
    deployment = _by_kind("Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    mounts = _mounts()
    config_dir = str(_config_arg().parent)
    assert mounts[config_dir]["configMap"]["name"] == _by_kind("ConfigMap")["metadata"]["name"]
    assert mounts[config_dir]["readOnly"] is True
    pvc = _by_kind("PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    data_dir = PurePosixPath(_proxy_config(tmp_path).store.path).parent
    assert data_dir.is_absolute()
    assert mounts[str(data_dir)]["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]
    assert mounts[str(data_dir)]["readOnly"] is False
    assert data_dir != _config_arg().parent


def test_service_reaches_the_proxy_port_only() -> None:
    deployment = _by_kind("Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    selector = _by_kind("Service")["spec"]["selector"]
    assert selector
    assert selector.items() <= pod_labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    port = _port("mcp")
    (service_port,) = _by_kind("Service")["spec"]["ports"]
    assert service_port["targetPort"] == port["name"]
    assert service_port["port"] == 80
    assert service_port["targetPort"] != _port("ops")["name"]  # metrics and readiness reasons stay in the pod
    proxy_name = _proxy_container()["name"]
    others = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] != proxy_name]
    assert others, "the legacy server runs in the same pod"
    assert all(p.get("name") != port["name"] for c in others for p in c.get("ports", [])), others


def test_probes_hit_health_paths_on_the_proxy_port() -> None:
    container = _proxy_container()
    port = _port("mcp")  # the bare probes: a status code, as the kubelet needs
    expected = {"livenessProbe": "/healthz", "readinessProbe": "/readyz", "startupProbe": "/healthz"}
    for probe, path in expected.items():
        if probe == "startupProbe" and probe not in container:
            continue
        assert container[probe]["httpGet"]["path"] == path, probe
        assert container[probe]["httpGet"]["port"] in (port["name"], port["containerPort"]), probe


def test_configmap_config_is_valid_and_matches_the_pod(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(_configmap_file(tmp_path))]) == 0
    assert "ok" in capsys.readouterr().out
    config = _proxy_config(tmp_path)
    port = _port("mcp")
    assert (config.listen.host, config.listen.port) == ("0.0.0.0", port["containerPort"])
    assert config.relay.prefixes == ["/.well-known/"], "a sidecar relays its server's OAuth metadata, nothing else"
    assert isinstance(config.upstream, HttpUpstreamConfig)
    assert urlsplit(config.upstream.url).hostname in LOOPBACK_HOSTS, "a sidecar reaches its server on loopback"
    assert config.tasks.tools, "the example shows tool policies"
    assert any("*" in name and policy.on_restart == "rerun" for name, policy in config.tasks.tools.items())
    assert any(not re.search(r"[*?\[]", name) for name in config.tasks.tools)
    assert config.observability.metrics, "the pod is annotated for scraping /metrics"
    ops = _port("ops")
    assert config.observability.port == ops["containerPort"]
    annotations = _by_kind("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(ops["containerPort"]),
        "prometheus.io/path": "/metrics",
    }
    # The operations listener binds the pod IP, from the downward API.
    (host,) = [item for item in _proxy_container()["env"] if item["name"] == "MCP_TASKS_PROXY_OBSERVABILITY__HOST"]
    assert host["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    monitor = yaml.safe_load((ROOT / "config" / "monitoring" / "podmonitor.yaml").read_text())
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == ops["name"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= (
        _by_kind("Deployment")["spec"]["template"]["metadata"]["labels"].items()
    )


CLOSE_SECONDS = 10  # after the drain and the grace: upstream cancellations, the lease, the database


def _stops_in_time(deployment: dict[str, Any], config: Config) -> None:
    """The pod's grace holds the proxy's drain, its shutdown grace and the close; the legacy container's preStop
    waits on the proxy's /drainz (on the proxy's port), so the legacy server outlives the drain."""
    spec = deployment["spec"]["template"]["spec"]
    needed = config.tasks.drain_seconds + config.listen.shutdown_grace_seconds + CLOSE_SECONDS
    assert spec["terminationGracePeriodSeconds"] >= needed
    (proxy,) = [c for c in spec["containers"] if c["name"] == _proxy_container()["name"]]
    (legacy,) = [c for c in spec["containers"] if c["name"] != proxy["name"]]
    assert "lifecycle" not in proxy, "the proxy gets SIGTERM at once and drains"
    wait = legacy["lifecycle"]["preStop"]["httpGet"]
    assert wait["path"] == "/drainz"
    assert wait["port"] in (config.listen.port, *(port["name"] for port in proxy["ports"]))
    assert "host" not in wait, "the kubelet calls the pod's IP, where the proxy listens"


def test_pod_stops_after_the_proxy_drain_and_the_legacy_server_waits_for_it(tmp_path: Path) -> None:
    _stops_in_time(_by_kind("Deployment"), _proxy_config(tmp_path))


def test_proxy_container_runs_the_image_locked_down() -> None:
    container = _proxy_container()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    version = pyproject["project"]["version"]
    assert container["image"] == f"mcp-tasks-proxy:{version}"  # what `make docker` tags
    rendered = _rendered_image(container["image"], _kustomization(KUBE_DIR)["images"])
    assert rendered.endswith(f"/mcp-tasks-proxy:{version}"), rendered  # pushed to a registry, same version
    assert "command" not in container, "keep the image's ENTRYPOINT"
    assert container["args"] == _exec_form(_one("CMD"))
    uid = _image_user()
    context = container["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["runAsUser"] == uid
    assert context["readOnlyRootFilesystem"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert _by_kind("Deployment")["spec"]["template"]["spec"]["securityContext"]["fsGroup"] == uid
    resources = container["resources"]
    assert resources["requests"]
    assert resources["limits"]


# --- the HEALTHCHECK command is light ------------------------------------------------------------------------

HEAVY_MODULES = {
    "aiohttp",
    "pydantic",
    "yaml",
    "structlog",
    "sqlite3",
    "proxy.edge.app",
    "proxy.config.schema",
    "proxy.upstream",
}


class _Health(http.server.BaseHTTPRequestHandler):
    """/ok answers 200, anything else 503."""

    def do_GET(self) -> None:
        status = 200 if self.path == "/ok" else 503
        self.send_response(status)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join()
    server.server_close()


def _imported_by(argv: list[str]) -> tuple[int, set[str]]:
    """Exit code and every module imported, from Python's own import-time report (`-X importtime`)."""
    environ = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    run = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, env=environ)
    modules = {line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}
    assert "proxy.cli" in modules, run.stderr[-2000:]  # the report is there
    return run.returncode, modules


def test_the_probe_answers_by_status_and_imports_nothing_heavy(health_server: str) -> None:
    """The image runs the probe every 30 s: it must not load the proxy (aiohttp, pydantic, the app), only the
    standard library's HTTP client. Exit 0 on 200, 1 on any other status or no answer at all."""
    code, modules = _imported_by([str(_script()), "probe", f"{health_server}/ok"])
    assert code == 0
    heavy = {name for name in modules for top in HEAVY_MODULES if name == top or name.startswith(f"{top}.")}
    assert heavy == set(), sorted(heavy)
    assert _imported_by([str(_script()), "probe", f"{health_server}/down"])[0] == 1
    assert _imported_by([str(_script()), "probe", f"http://127.0.0.1:{free_port()}/healthz"])[0] == 1


@pytest.mark.parametrize("namespace", ["default", "team-a", "mcp-prod-2"])
def test_the_service_names_pass_the_host_check_in_any_namespace(tmp_path: Path, namespace: str) -> None:
    """The example is applied to whatever namespace the operator picks: the Service's DNS names in that namespace
    pass without editing the ConfigMap, and public look-alikes do not."""
    allowed = _proxy_config(tmp_path).security.allowed_hosts
    service = _by_kind("Service")["metadata"]["name"]
    for name in (service, f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local", *LOOPBACK_HOSTS):
        assert host_allowed(f"{name}:80", allowed), name
    for name in (f"{service}.com", f"{service}.{namespace}.svc.evil.example", "evil.example", f"x.{namespace}.svc"):
        assert not host_allowed(name, allowed), name


def test_the_pod_mounts_no_service_account_token() -> None:
    """Neither container talks to the Kubernetes API: a mounted token would only serve an attacker."""
    assert _by_kind("Deployment")["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_the_legacy_container_is_locked_down_too() -> None:
    proxy_name = _proxy_container()["name"]
    containers = _by_kind("Deployment")["spec"]["template"]["spec"]["containers"]
    (legacy,) = [c for c in containers if c["name"] != proxy_name]
    context = legacy["securityContext"]
    assert context["runAsNonRoot"] is True
    assert context["allowPrivilegeEscalation"] is False
    assert context["capabilities"] == {"drop": ["ALL"]}
    assert context["readOnlyRootFilesystem"] is True


# Measured on the proxy process (python -m proxy serve, Python 3.11): about 68 MiB resident when idle after the
# first calls; each modern tools/call with a body of max_body_bytes (4 MiB) whose result is as large adds about
# 15.5 MiB at its peak while in flight (16 at once: 316 MiB), i.e. just under 4 x max_body_bytes.
IDLE_MIB = 70
PER_CALL_BODIES = 4
CALLS_AT_ONCE = 16  # the budget the example's limit is sized for


def _mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "K": 1e3 / 2**20, "M": 1e6 / 2**20, "G": 1e9 / 2**20}
    for unit, factor in sorted(units.items(), key=lambda item: -len(item[0])):
        if quantity.endswith(unit):
            return float(quantity[: -len(unit)]) * factor
    return float(quantity) / 2**20


def test_the_proxy_memory_fits_its_configured_body_cap(tmp_path: Path) -> None:
    """The limit covers the idle process plus CALLS_AT_ONCE calls at the configured body cap, and the request
    the idle process: raising `security.max_body_bytes` in the ConfigMap without the limit fails here."""
    resources = _proxy_container()["resources"]
    body_mib = _proxy_config(tmp_path).security.max_body_bytes / 2**20
    assert _mebibytes(resources["limits"]["memory"]) >= IDLE_MIB + CALLS_AT_ONCE * PER_CALL_BODIES * body_mib
    assert _mebibytes(resources["requests"]["memory"]) >= IDLE_MIB


# --- Kubernetes: several replicas on PostgreSQL (config/kubernetes/replicated) --------------------------------

REPLICATED_DIR = KUBE_DIR / "replicated"
STORE_SECRET = "mcp-tasks-proxy-store"
KEY_SECRET = "mcp-tasks-proxy-request-state"


def _replicated() -> list[dict[str, Any]]:
    """The overlay as kustomize renders it: the resources its kustomization lists, read from their files (it
    holds whole manifests only, so reading them is rendering them)."""
    kustomization = yaml.safe_load((REPLICATED_DIR / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert set(kustomization) <= {"apiVersion", "kind", "resources", "images"}, "patches or generators: use kustomize"
    documents = []
    for name in kustomization["resources"]:
        assert (REPLICATED_DIR / name).is_file(), f"{name}: a file of the overlay (not a directory or a parent)"
        documents += [doc for doc in yaml.safe_load_all((REPLICATED_DIR / name).read_text()) if doc is not None]
    return [_with_images(document, kustomization.get("images", [])) for document in documents]


def _replicated_kind(kind: str) -> dict[str, Any]:
    found = [document for document in _replicated() if document["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def _replicated_proxy() -> dict[str, Any]:
    containers = _replicated_kind("Deployment")["spec"]["template"]["spec"]["containers"]
    (proxy,) = [c for c in containers if c["name"] == _proxy_container()["name"]]
    return dict(proxy)


def test_the_replicated_example_lists_every_file_once_and_each_object_once() -> None:
    kinds = sorted(document["kind"] for document in _replicated())
    assert kinds == ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service"]  # no volume claim
    on_disk = sorted(path.name for path in REPLICATED_DIR.glob("*.yaml") if path.name != "kustomization.yaml")
    assert sorted(yaml.safe_load((REPLICATED_DIR / "kustomization.yaml").read_text())["resources"]) == on_disk


@pytest.mark.parametrize("kind", ["ConfigMap", "Deployment", "PodDisruptionBudget", "Service"])
def test_the_replicated_manifests_are_valid_kubernetes_objects(kind: str) -> None:
    document = _replicated_kind(kind)
    assert kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_kubectl_kustomize_renders_the_replicated_example_the_same() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here: the overlay is rendered by reading its files only")
    run = subprocess.run(
        [kubectl, "kustomize", str(REPLICATED_DIR)], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stderr
    rendered = [doc for doc in yaml.safe_load_all(run.stdout) if doc is not None]

    def key(document: dict[str, Any]) -> tuple[str, str]:
        return document["kind"], document["metadata"]["name"]

    assert sorted(rendered, key=key) == sorted(_replicated(), key=key)


def test_the_replicated_deployment_rolls_without_downtime_and_survives_a_node() -> None:
    deployment = _replicated_kind("Deployment")
    spec = deployment["spec"]
    assert spec["replicas"] == 3
    assert spec["strategy"]["type"] == "RollingUpdate"
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert spec["strategy"]["rollingUpdate"]["maxSurge"] >= 1
    pod_labels = spec["template"]["metadata"]["labels"]
    (spread,) = spec["template"]["spec"]["topologySpreadConstraints"]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    assert spread["labelSelector"]["matchLabels"].items() <= pod_labels.items()
    budget = _replicated_kind("PodDisruptionBudget")["spec"]
    assert budget["selector"]["matchLabels"].items() <= pod_labels.items()
    assert budget["maxUnavailable"] == 1  # two of three pods serve through a drain
    assert _replicated_proxy()["readinessProbe"]["httpGet"]["path"] == "/readyz"  # the store and the lease


def _mounted_file(path: str) -> tuple[str, str]:
    """(Secret name, key) of the file `path` in the proxy container's mounted Secret volumes."""
    volumes = {v["name"]: v for v in _replicated_kind("Deployment")["spec"]["template"]["spec"]["volumes"]}
    for mount in _replicated_proxy()["volumeMounts"]:
        secret = volumes[mount["name"]].get("secret")
        if secret is None or not path.startswith(mount["mountPath"] + "/"):
            continue
        assert mount["readOnly"] is True
        assert secret["defaultMode"] & 0o007 == 0, "not readable by other users"
        relative = path.removeprefix(mount["mountPath"] + "/")
        (item,) = [item for item in secret["items"] if item["path"] == relative]
        return secret["secretName"], item["key"]
    raise AssertionError(f"{path} is in no mounted Secret")


def test_the_replicated_pods_stop_after_the_drain_and_the_legacy_server_waits_for_it(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("k" * 64)
    config_file = tmp_path / "proxy.yaml"
    config_file.write_text(_replicated_kind("ConfigMap")["data"][_config_arg().name].replace(KEY_FILE, str(key)))
    config = load_config(config_file, environ={})
    _stops_in_time(_replicated_kind("Deployment"), config)
    # While one pod drains, a rollout keeps every other pod serving (surge, not unavailability), and the budget
    # counts the draining pod, so voluntary evictions wait for its drain.
    rollout = _replicated_kind("Deployment")["spec"]["strategy"]["rollingUpdate"]
    assert (rollout["maxUnavailable"], rollout["maxSurge"]) == (0, 1)
    assert _replicated_kind("PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


def test_the_replicated_pods_read_the_store_and_the_shared_key_from_secrets(tmp_path: Path) -> None:
    """The database URL is a Secret's value; the password and the requestState key are files of mounted
    Secrets; nothing of the single-replica SQLite volume is left; and the proxy loads the config the pod gets."""
    spec = _replicated_kind("Deployment")["spec"]["template"]["spec"]
    assert not [volume for volume in spec["volumes"] if "persistentVolumeClaim" in volume]
    env = {item["name"]: item for item in _replicated_proxy()["env"]}
    assert env["MCP_TASKS_PROXY_STORE__URL"]["valueFrom"]["secretKeyRef"] == {"name": STORE_SECRET, "key": "url"}
    password = env["MCP_TASKS_PROXY_STORE__PASSWORD_FILE"]["value"]
    key = env["MCP_TASKS_PROXY_INPUTS__SECRET_FILE"]["value"]
    assert _mounted_file(password) == (STORE_SECRET, "password")
    assert _mounted_file(key) == (KEY_SECRET, "key")
    config_file = tmp_path / "proxy.yaml"
    (tmp_path / "deployment-key").write_text("d" * 64)
    config_file.write_text(
        _replicated_kind("ConfigMap")["data"][_config_arg().name].replace(KEY_FILE, str(tmp_path / "deployment-key"))
    )
    (tmp_path / "password").write_text("secret\n")
    (tmp_path / "key").write_text("k" * 64)
    config = load_config(
        config_file,
        environ={
            "MCP_TASKS_PROXY_STORE__URL": "postgresql://mcp_tasks_proxy@postgres:5432/mcp_tasks_proxy",
            "MCP_TASKS_PROXY_STORE__PASSWORD_FILE": str(tmp_path / "password"),
            "MCP_TASKS_PROXY_INPUTS__SECRET_FILE": str(tmp_path / "key"),
        },
    )
    assert config.store.url is not None
    assert config.store.password_file == str(tmp_path / "password")
    assert config.inputs.secret_file is not None
    assert config.security.key_file is not None  # every pod hashes principals with the same key


def test_the_replicated_example_differs_from_the_single_replica_one_only_where_it_must(tmp_path: Path) -> None:
    """Same Service, same tool policies and settings but the store, the same containers but for how the proxy
    reaches its store and key: the two examples cannot drift apart unnoticed."""
    assert _replicated_kind("Service") == _by_kind("Service")
    single = yaml.safe_load(_by_kind("ConfigMap")["data"][_config_arg().name])
    replicated = yaml.safe_load(_replicated_kind("ConfigMap")["data"][_config_arg().name])
    assert {k: v for k, v in single.items() if k != "store"} == {k: v for k, v in replicated.items() if k != "store"}
    assert _replicated_kind("ConfigMap")["metadata"] == _by_kind("ConfigMap")["metadata"]
    assert _kustomization(REPLICATED_DIR)["images"] == _kustomization(KUBE_DIR)["images"]
    rendered = _with_images(_by_kind("Deployment"), _kustomization(KUBE_DIR)["images"])
    base, pods = rendered["spec"]["template"], _replicated_kind("Deployment")["spec"]["template"]
    assert pods["metadata"] == base["metadata"]
    legacy = [c for c in base["spec"]["containers"] if c["name"] != _proxy_container()["name"]]
    assert [c for c in pods["spec"]["containers"] if c["name"] != _proxy_container()["name"]] == legacy

    def without(container: dict[str, Any], *names: str) -> dict[str, Any]:
        return {k: v for k, v in container.items() if k not in names}

    (proxy,) = [c for c in base["spec"]["containers"] if c["name"] == _proxy_container()["name"]]
    assert without(_replicated_proxy(), "env", "volumeMounts") == without(proxy, "env", "volumeMounts")
    assert pods["spec"]["securityContext"] == base["spec"]["securityContext"]
    assert pods["spec"]["automountServiceAccountToken"] is False


# --- Kubernetes: behind an authenticating ingress (config/kubernetes/oauth) ------------------------------------

OAUTH_DIR = KUBE_DIR / "oauth"


def _oauth(kind: str) -> dict[str, Any]:
    found = [
        document
        for path in sorted(OAUTH_DIR.glob("*.yaml"))
        for document in yaml.safe_load_all(path.read_text())
        if document is not None and document["kind"] == kind
    ]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    document: dict[str, Any] = found[0]
    return document


@pytest.mark.parametrize("kind", ["ConfigMap", "Ingress"])
def test_the_ingress_example_manifests_are_valid_kubernetes_objects(kind: str) -> None:
    assert kubernetes_validate.validate(_oauth(kind), KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_the_ingress_example_trusts_only_the_header_its_authentication_sets(tmp_path: Path) -> None:
    """The proxy's principal header is the one the ingress copies from its authentication answer (replacing the
    client's), callers without it are refused, the public host passes the Host check, the Ingress reaches the
    base example's Service port, and the ConfigMap replaces the base one (same name)."""
    configmap = _oauth("ConfigMap")
    assert configmap["metadata"]["name"] == _by_kind("ConfigMap")["metadata"]["name"]
    key = tmp_path / "key"
    key.write_text("k" * 64)
    path = tmp_path / "proxy.yaml"
    path.write_text(configmap["data"]["proxy.yaml"].replace(KEY_FILE, str(key)))
    config = load_config(path, environ={})
    ingress = _oauth("Ingress")
    trusted = ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/auth-response-headers"]
    assert config.security.principal_header.lower() == trusted.lower()
    assert config.security.anonymous == "refuse"
    (rule,) = ingress["spec"]["rules"]
    assert rule["host"] in config.security.allowed_hosts
    (route,) = rule["http"]["paths"]
    service = _by_kind("Service")
    assert route["backend"]["service"]["name"] == service["metadata"]["name"]
    assert route["backend"]["service"]["port"]["name"] in {port["name"] for port in service["spec"]["ports"]}


# --- make docker: BuildKit or podman, or a sentence saying what to install -------------------------------------------


def _make_docker(tmp_path: Path, tools: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """`make docker` with a PATH that holds only `sed` (the Makefile reads the version with it) and `tools`:
    scripts standing in for docker and podman (neither is installed here), each logging its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    sed = shutil.which("sed")
    assert sed is not None
    (bin_dir / "sed").symlink_to(sed)
    calls = tmp_path / "calls"
    for name, body in tools.items():
        script = bin_dir / name
        script.write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n{body}\n')
        script.chmod(0o755)
    make = shutil.which("make")
    assert make is not None
    done = subprocess.run(
        [make, "--no-print-directory", "docker"],
        cwd=ROOT,
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return done, calls.read_text().splitlines() if calls.exists() else []


def test_make_docker_says_what_to_install_without_buildkit_or_podman(tmp_path: Path) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    done, calls = _make_docker(tmp_path, {})
    assert done.returncode != 0
    assert "neither docker (with BuildKit) nor podman is installed" in done.stderr
    done, calls = _make_docker(tmp_path / "old", {"docker": 'test "$1" != buildx'})  # a docker without buildx
    assert done.returncode != 0
    assert "this docker has no BuildKit (the buildx plugin)" in done.stderr
    assert "apt-get install docker-buildx" in done.stderr
    assert calls == ["docker buildx version"]  # nothing built with the legacy builder
    done, calls = _make_docker(tmp_path / "podman", {"podman": "exit 0"})
    assert done.returncode == 0, done.stderr
    assert calls == [f"podman build --format docker -t mcp-tasks-proxy:{version} -t mcp-tasks-proxy:latest ."]
    done, calls = _make_docker(tmp_path / "buildx", {"docker": "exit 0", "podman": "exit 0"})
    assert done.returncode == 0, done.stderr
    assert calls == ["docker buildx version", f"docker build -t mcp-tasks-proxy:{version} -t mcp-tasks-proxy:latest ."]


# --- the sidecar Component: the proxy added to a Deployment you already have --------------------------------------

SIDECAR_DIR = KUBE_DIR / "sidecar"
YOUR_DEPLOYMENT: dict[str, Any] = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "my-mcp-server", "labels": {"app": "my-mcp-server"}},
    "spec": {
        "replicas": 1,
        "selector": {"matchLabels": {"app": "my-mcp-server"}},
        "template": {
            "metadata": {"labels": {"app": "my-mcp-server"}},
            "spec": {
                "initContainers": [{"name": "migrate", "image": "my-mcp-server:1.0.0", "args": ["migrate"]}],
                "containers": [
                    {
                        "name": "server",
                        "image": "my-mcp-server:1.0.0",
                        "env": [{"name": "HOST", "value": "127.0.0.1"}, {"name": "PORT", "value": "9000"}],
                        "volumeMounts": [{"name": "cache", "mountPath": "/cache"}],
                    }
                ],
                "volumes": [{"name": "cache", "emptyDir": {}}],
            },
        },
    },
}
YOUR_SERVICE: dict[str, Any] = {
    "apiVersion": "v1",
    "kind": "Service",
    "metadata": {"name": "my-mcp-server"},
    "spec": {"selector": {"app": "my-mcp-server"}, "ports": [{"name": "http", "port": 80, "targetPort": 9000}]},
}


def _guide_block(marker: str) -> str:
    text = KUBERNETES_GUIDE.read_text()
    start = text.index("```", text.index(marker))
    body = text[text.index("\n", start) + 1 :]
    return body[: body.index("```")]


def _kustomize(directory: Path) -> list[dict[str, Any]]:
    """`kubectl kustomize DIRECTORY`'s documents; skips (saying why) without a kubectl whose kustomize knows
    Components (Debian's kubernetes-client 1.20 does not: install kubectl from kubernetes.io)."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here: install it (kubernetes.io/docs/tasks/tools) to render the sidecar Component")
    run = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=False
    )
    if run.returncode != 0 and "Component" in run.stderr and "kind" in run.stderr:
        pytest.skip(f"this kubectl's kustomize predates Components: {run.stderr.strip()[:200]}")
    assert run.returncode == 0, run.stderr
    return [document for document in yaml.safe_load_all(run.stdout) if document is not None]


def _your_app_with_the_sidecar(tmp_path: Path) -> list[dict[str, Any]]:
    """Your Deployment and Service, unchanged, with the guide's kustomization and the Component copied in."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "deployment.yaml").write_text(yaml.safe_dump(YOUR_DEPLOYMENT))
    (app / "service.yaml").write_text(yaml.safe_dump(YOUR_SERVICE))
    shutil.copytree(SIDECAR_DIR, app / "mcp-tasks-proxy")
    (app / "kustomization.yaml").write_text(_guide_block("<!-- sidecar: kustomization -->"))
    return _kustomize(app)


def _of_kind(documents: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [document for document in documents if document["kind"] == kind]
    return found


def test_the_sidecar_component_adds_the_proxy_to_your_deployment_and_your_service_to_it(tmp_path: Path) -> None:
    rendered = _your_app_with_the_sidecar(tmp_path)
    assert sorted(document["kind"] for document in rendered) == ["ConfigMap", "Deployment", "Service"]
    spec = _of_kind(rendered, "Deployment")["spec"]["template"]["spec"]
    yours = YOUR_DEPLOYMENT["spec"]["template"]["spec"]
    assert spec["containers"] == yours["containers"]  # your server, unchanged
    by_name = {container["name"]: container for container in spec["initContainers"]}
    assert sorted(by_name) == ["mcp-tasks-proxy", "migrate"]
    assert by_name["migrate"] == yours["initContainers"][0]  # yours kept
    proxy = by_name["mcp-tasks-proxy"]
    assert proxy["restartPolicy"] == "Always"  # a native sidecar
    assert proxy["image"] == "registry.example.com/your-team/mcp-tasks-proxy:0.1.0"  # your kustomization's images:
    assert {volume["name"] for volume in spec["volumes"]} >= {"cache", "mcp-tasks-proxy-config", "mcp-tasks-proxy-key"}
    assert {mount["name"] for mount in proxy["volumeMounts"]} <= {volume["name"] for volume in spec["volumes"]}
    ports = {port["name"]: port["containerPort"] for port in proxy["ports"]}
    (service_port,) = _of_kind(rendered, "Service")["spec"]["ports"]
    assert service_port["targetPort"] == ports["mcp"]  # clients reach the server through the proxy only
    config = yaml.safe_load(_of_kind(rendered, "ConfigMap")["data"]["proxy.yaml"])
    assert config["listen"]["port"] == ports["mcp"]
    assert config["observability"]["port"] == ports["ops"]
    assert urlsplit(config["upstream"]["url"]).hostname in LOOPBACK_HOSTS  # your server, in the same pod
    (mount,) = [m for m in proxy["volumeMounts"] if m["name"] == "mcp-tasks-proxy-config"]
    assert proxy["args"] == ["serve", "--config", f"{mount['mountPath']}/proxy.yaml"]
    assert {probe: proxy[probe]["httpGet"]["port"] for probe in ("startupProbe", "readinessProbe")} == {
        "startupProbe": ports["mcp"],
        "readinessProbe": ports["mcp"],
    }
    for document in rendered:
        assert kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def test_the_sidecars_config_passes_check_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    configmap = yaml.safe_load((SIDECAR_DIR / "configmap.yaml").read_text())
    file = tmp_path / "proxy.yaml"
    file.write_text(configmap["data"]["proxy.yaml"])
    assert main(["check-config", str(file)]) == 0
    captured = capsys.readouterr()
    assert "security.key_file: read at start" in captured.err  # the Secret, mounted only in the pod


def test_the_plain_container_variant_of_the_guide_is_a_valid_pod_for_older_clusters(tmp_path: Path) -> None:
    """The guide's variant: the proxy moved to `containers` without `restartPolicy`, and your server's preStop
    hook waiting on the proxy's /drainz."""
    rendered = _your_app_with_the_sidecar(tmp_path)
    deployment = _of_kind(rendered, "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    (proxy,) = [container for container in spec["initContainers"] if container["name"] == "mcp-tasks-proxy"]
    spec["initContainers"].remove(proxy)
    del proxy["restartPolicy"]
    spec["containers"].append(proxy)
    hook = yaml.safe_load(_guide_block("**Clusters before Kubernetes 1.29"))
    spec["containers"][0]["lifecycle"] = hook["lifecycle"]
    spec["terminationGracePeriodSeconds"] = 35
    assert kubernetes_validate.validate(deployment, "1.27", strict=True) == "1.27"
    assert hook["lifecycle"]["preStop"]["httpGet"]["port"] == next(
        port["containerPort"] for port in proxy["ports"] if port["name"] == "mcp"
    )
