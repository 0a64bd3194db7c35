"""The container image, run for real with podman: `make image-test` runs this after image/build.sh built it.

Starts the image as a sidecar would run (its own network namespace shared with the example legacy server,
non-root, read-only root file system, no capabilities), drives it with a 2026-07-28 client over HTTP, runs
the image's own HEALTHCHECK, stops it with SIGTERM while a task runs (the drain: the task completes, then
the process exits 0), and prints the figures. Exits non-zero on any failure.
Imports nothing from proxy/: the image is tested from outside, as an operator sees it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
MODERN = "2026-07-28"
TASKS = "io.modelcontextprotocol/tasks"
DATA_DIR = "/var/lib/mcp-tasks-proxy"  # the image's VOLUME: the only writable path
UPSTREAM_PORT = 9000  # config/docker.yaml's upstream, inside the shared network namespace (not the host's)
REQUIRED_TOOL = "slow_compute"  # tests/upstream's task fixture; given `mode: required` by the environment
UPSTREAM_TIMEOUT_S = 60
READY_TIMEOUT_S = 90
TASK_TIMEOUT_S = 60
DRAIN_TASK_S = 3.0  # the task SIGTERM arrives during; well within the image's drain (tasks.drain_seconds, 20 s)
STOP_TIMEOUT_S = 30


class SmokeError(Exception):
    """A property of the running image that does not hold."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise SmokeError(message)


class Podman:
    """The podman CLI with this sandbox's settings: runc, and the containers.conf that image/build.sh wrote."""

    def __init__(self, work: Path) -> None:
        conf = work / "containers.conf"
        check(conf.exists(), f"{conf} missing: run image/build.sh first")
        self.env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def run(self, *args: str, check_rc: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        try:
            done = subprocess.run(
                ["podman", "--runtime", "runc", *args],
                capture_output=True,
                text=True,
                env=self.env,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired as error:
            raise SmokeError(f"podman {' '.join(args)}: no answer within {timeout} s") from error
        if check_rc and done.returncode != 0:
            raise SmokeError(f"podman {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def out(self, *args: str) -> str:
        return self.run(*args).stdout.strip()

    def pid(self, name: str) -> int:
        return int(self.out("inspect", "--format", "{{.State.Pid}}", name))


def rss_kib(pid: int) -> int:
    """Resident set size of a host process (a container's PID 1 seen from the host), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise SmokeError(f"no VmRSS for pid {pid}")


async def poll(what: str, timeout_s: float, attempt: Callable[[], Awaitable[bool]]) -> float:
    """Retry `attempt` until it returns True; the seconds it took. Fails with `what` after `timeout_s`."""
    start = time.monotonic()
    while not await attempt():
        check(time.monotonic() - start < timeout_s, f"{what}: not within {timeout_s} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


class Client:
    """A 2026-07-28 client declaring the Tasks extension, over the proxy's published port."""

    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session = session
        self.base = base
        self.ids = 0

    async def status(self, path: str) -> int:
        try:
            async with self.session.get(self.base + path) as response:
                return response.status
        except aiohttp.ClientError:
            return 0

    async def rpc(self, method: str, params: dict[str, Any], name: str | None = None) -> dict[str, Any]:
        self.ids += 1
        meta = {
            "io.modelcontextprotocol/protocolVersion": MODERN,
            "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS: {}}},
            "io.modelcontextprotocol/clientInfo": {"name": "image-smoke", "version": "1"},
        }
        headers = {
            "Accept": "application/json, text/event-stream",
            "MCP-Protocol-Version": MODERN,
            "Mcp-Method": method,
            **({"Mcp-Name": name} if name else {}),
        }
        body = {"jsonrpc": "2.0", "id": self.ids, "method": method, "params": {**params, "_meta": meta}}
        async with self.session.post(self.base + "/mcp", json=body, headers=headers) as response:
            text = await response.text()
            if response.headers.get("Content-Type", "").startswith("text/event-stream"):
                data = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
                messages = [json.loads(item) for item in data if item]
            else:
                messages = [json.loads(text)]
        check(response.status == 200, f"{method}: HTTP {response.status}: {text[:500]}")
        final: dict[str, Any] = messages[-1]
        check(final.get("id") == self.ids and "result" in final, f"{method}: {final}")
        result: dict[str, Any] = final["result"]
        return result


class Smoke:
    """One run: the network namespace holder, the legacy server inside it, the proxy container, the figures."""

    def __init__(self, podman: Podman, image: str, stack: ExitStack) -> None:
        self.podman = podman
        self.image = image
        self.stack = stack
        self.holder = f"mcp-tasks-proxy-netns-{os.getpid()}"
        self.proxy = f"mcp-tasks-proxy-smoke-{os.getpid()}"
        self.volume = f"mcp-tasks-proxy-data-{os.getpid()}"
        self.figures: dict[str, str] = {}

    def start_holder(self) -> str:
        """A container that only holds a network namespace (what a pod's infra container does), publishing the
        proxy's port 8080 on an ephemeral loopback port of the host; returns the host's base URL."""
        self.stack.callback(self.podman.run, "rm", "--force", "--volumes", "--time", "0", self.holder, check_rc=False)
        self.podman.run(
            *("run", "--detach", "--name", self.holder, "--publish", "127.0.0.1::8080", "--read-only"),
            *("--cap-drop", "all", "--entrypoint", "/bin/sleep", self.image, "infinity"),
        )
        return "http://" + self.podman.out("port", self.holder, "8080/tcp").splitlines()[0]

    def start_upstream(self, log: Path) -> None:
        """The example legacy server (tests/upstream, the host's environment) on 127.0.0.1:9000 of the holder's
        network namespace: the proxy reaches it at config/docker.yaml's upstream URL, as in a pod."""
        argv = [
            *("nsenter", "--target", str(self.podman.pid(self.holder)), "--net", "--"),
            *(sys.executable, "-m", "tests.upstream", "--host", "127.0.0.1", "--port", str(UPSTREAM_PORT)),
        ]
        sink = self.stack.enter_context(log.open("wb"))
        process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=sink)
        self.stack.callback(stop_process, process)
        assert process.stdout is not None
        started, _, _ = select.select([process.stdout], [], [], UPSTREAM_TIMEOUT_S)
        check(bool(started), f"the legacy server printed nothing within {UPSTREAM_TIMEOUT_S} s, see {log}")
        line = process.stdout.readline().decode()
        check(line.startswith("ready "), f"the legacy server did not start: {line!r}, see {log}")

    def start_proxy(self) -> None:
        """The image as built, with its ENTRYPOINT, CMD, USER and HEALTHCHECK. The only writable path is a new
        volume on the image's VOLUME, which podman fills from the image (so it belongs to whoever the image
        made own that directory); one tool is made task-required from the environment."""
        self.stack.callback(self.podman.run, "volume", "rm", "--force", self.volume, check_rc=False)
        self.stack.callback(self.podman.run, "rm", "--force", "--volumes", "--time", "0", self.proxy, check_rc=False)
        self.podman.run("volume", "create", self.volume)
        self.podman.run(
            *("run", "--detach", "--name", self.proxy, "--network", f"container:{self.holder}"),
            *("--read-only", "--read-only-tmpfs=false", "--volume", f"{self.volume}:{DATA_DIR}"),
            *("--cap-drop", "all", "--security-opt", "no-new-privileges"),
            *("--env", f"MCP_TASKS_PROXY_TASKS__TOOLS={{{REQUIRED_TOOL}: {{mode: required}}}}"),
            self.image,
        )

    async def ready(self, client: Client) -> bool:
        """/readyz answers 200; fails at once when the container has stopped."""
        state = self.podman.out("inspect", "--format", "{{.State.Status}} {{.State.ExitCode}}", self.proxy)
        check(state.startswith("running"), f"the proxy container is {state}")
        return await client.status("/readyz") == 200

    def logs(self, tail: int | None = 3000) -> str:
        done = self.podman.run("logs", self.proxy, check_rc=False)
        return (done.stdout + done.stderr)[-tail if tail else 0 :]

    def assert_confined(self) -> None:
        """Non-root, read-only root file system, writable data directory: checked inside the running container."""
        uid = self.podman.out("exec", self.proxy, "id", "-u")
        check(
            uid != "0" and uid == self.podman.out("image", "inspect", "--format", "{{.Config.User}}", self.image),
            f"the proxy runs as uid {uid}, not the image's USER",
        )
        status = Path(f"/proc/{self.podman.pid(self.proxy)}/status").read_text()
        check(any(line.split()[:2] == ["Uid:", uid] for line in status.splitlines()), "PID 1 is not the image's user")
        for path in ("/etc/mcp-tasks-proxy/probe", "/opt/venv/probe", "/tmp/probe"):
            write = self.podman.run("exec", self.proxy, "touch", path, check_rc=False)
            check(write.returncode != 0 and "Read-only file system" in write.stderr, f"{path} is writable: {write}")
        listing = self.podman.out("exec", self.proxy, "ls", DATA_DIR).split()
        check("tasks.db" in listing, f"no task database in {DATA_DIR}: {listing}")

    def healthcheck(self) -> None:
        """The image's own HEALTHCHECK, as podman runs it (inside the container)."""
        test = json.loads(
            self.podman.out("image", "inspect", "--format", "{{json .Config.Healthcheck.Test}}", self.image)
        )
        check(test[:3] == ["CMD", "mcp-tasks-proxy", "probe"], f"unexpected HEALTHCHECK {test}")
        done = self.podman.run("healthcheck", "run", self.proxy, check_rc=False)
        check(done.returncode == 0, f"HEALTHCHECK failed ({done.returncode}): {done.stdout}{done.stderr}")

    async def smoke(self, client: Client) -> None:
        discover = await client.rpc("server/discover", {})
        check(MODERN in discover["supportedVersions"], f"server/discover: {discover}")
        check(TASKS in discover["capabilities"].get("extensions", {}), f"no Tasks extension: {discover}")
        arguments = {"seconds": 0.3, "label": "image"}
        created = await client.rpc("tools/call", {"name": REQUIRED_TOOL, "arguments": arguments}, REQUIRED_TOOL)
        check(created.get("resultType") == "task", f"a required tool did not become a task: {created}")
        task_id = created["taskId"]
        last: dict[str, Any] = {}

        async def completed() -> bool:
            nonlocal last
            last = await client.rpc("tasks/get", {"taskId": task_id}, task_id)
            status = str(last["status"])
            check(status in {"working", "completed"}, f"task {task_id}: {last}")
            return status == "completed"

        seconds = await poll(f"task {task_id} completed", TASK_TIMEOUT_S, completed)
        text = "".join(block.get("text", "") for block in last["result"]["content"])
        check("label=image" in text, f"task result: {last}")
        self.figures["task to completion"] = f"{seconds:.2f} s"

    async def stop(self, client: Client) -> None:
        """SIGTERM while a task runs, as `podman stop` and the kubelet send it: the proxy turns unready, drains
        (the task goes on to complete), then exits by itself, with 0."""
        arguments = {"seconds": DRAIN_TASK_S, "label": "drain"}
        created = await client.rpc("tools/call", {"name": REQUIRED_TOOL, "arguments": arguments}, REQUIRED_TOOL)
        check(created.get("resultType") == "task", f"a required tool did not become a task: {created}")
        task_id = created["taskId"]
        sent = time.time()
        self.podman.run("kill", "--signal", "TERM", self.proxy)

        async def unready() -> bool:
            return await client.status("/readyz") == 503

        await poll("/readyz 503 while the task drains", DRAIN_TASK_S, unready)
        code = self.podman.run("wait", self.proxy, timeout=STOP_TIMEOUT_S).stdout.strip()
        check(code == "0", f"exit code {code} after SIGTERM:\n{self.logs()}")
        events = [json.loads(line) for line in self.logs(None).splitlines() if line.startswith("{")]
        settled = [event.get("status") for event in events if event.get("event") == "task_settled"]
        mine = [event for event in events if event.get("task_id") == task_id and event.get("event") == "task_settled"]
        check([event.get("status") for event in mine] == ["completed"], f"the task did not complete: {settled}")
        drained = [event.get("reason") for event in events if event.get("event") == "drain_finished"]
        check(drained == ["idle"], f"the drain did not end with nothing left to run: {drained}")
        finished = int(self.podman.out("inspect", "--format", "{{.State.FinishedAt.UnixNano}}", self.proxy))
        self.figures[f"SIGTERM to exit (a {DRAIN_TASK_S:g} s task running)"] = f"{finished / 1e9 - sent:.2f} s"


def stop_process(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def build_figures(work: Path) -> dict[str, str]:
    """What image/build.sh measured."""
    raw = dict(line.split() for line in (work / "build-times").read_text().splitlines() if line.strip())
    figures = {}
    if "base_seconds" in raw:
        figures["base image (mmdebstrap + import)"] = f"{raw['base_seconds']} s"
    figures["wheels (host pip)"] = f"{raw['wheels_seconds']} s"
    figures["image build (podman build)"] = f"{raw['build_seconds']} s"
    figures["image size"] = f"{int(raw['image_bytes']) / 1e6:.1f} MB"
    return figures


async def run(work: Path, image: str) -> dict[str, str]:
    podman = Podman(work)
    figures = build_figures(work)
    with ExitStack() as stack:
        smoke = Smoke(podman, image, stack)
        base = smoke.start_holder()
        smoke.start_upstream(work / "upstream.log")
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
            client = Client(session, base)
            start = time.monotonic()
            smoke.start_proxy()
            try:
                await poll("/readyz 200", READY_TIMEOUT_S, lambda: smoke.ready(client))
                figures["time to ready (run to /readyz 200)"] = f"{time.monotonic() - start:.2f} s"
                figures["idle RSS after start"] = f"{rss_kib(podman.pid(smoke.proxy)) / 1024:.1f} MiB"
                check(await client.status("/healthz") == 200, "/healthz is not 200")
                smoke.assert_confined()
                smoke.healthcheck()
                await smoke.smoke(client)
                figures["idle RSS after the smoke test"] = f"{rss_kib(podman.pid(smoke.proxy)) / 1024:.1f} MiB"
                await smoke.stop(client)
            except (SmokeError, aiohttp.ClientError, TimeoutError) as error:
                raise SmokeError(f"{error}\n--- proxy log ---\n{smoke.logs()}") from error
        figures.update(smoke.figures)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "image", help="image/build.sh's WORK")
    parser.add_argument("--image", default="localhost/mcp-tasks-proxy:image-test")
    args = parser.parse_args(argv)
    try:
        figures = asyncio.run(run(args.work, args.image))
    except SmokeError as error:
        print(f"image-test: FAILED: {error}", file=sys.stderr)
        return 1
    print(
        "image-test: passed: server/discover, a required tool's task to completion, the HEALTHCHECK, "
        "SIGTERM while a task runs: the task completes, exit 0"
    )
    width = max(map(len, figures))
    for name, value in figures.items():
        print(f"  {name:<{width}}  {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
