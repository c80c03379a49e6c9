"""How fast the kernel and Redis say that a process died, and what they say of one cut off by the network.

Measurements behind two ways of noticing a dead worker sooner than its lease does (no celery-orphans code
runs here; each is a fact of this machine's kernel and Redis):

- **pidfd** (Linux 5.3 and later): a process opens ``os.pidfd_open(pid)`` on a neighbour, not its child,
  and waits in ``poll()``; the time from ``SIGKILL`` to the descriptor becoming readable, for a small
  process and for ones holding 100 MB and 1 GB (the kernel frees a process's memory before it reports
  its exit).
- **Redis and a SIGKILLed client**: a client process holds a connection to a Redis server of its own,
  subscribed to a channel of its own (``SUBSCRIBE``), blocked on a key of its own (``BLPOP``), or idle
  under a name of its own (``CLIENT SETNAME``); the time from ``SIGKILL`` to Redis no longer counting it
  (``PUBSUB NUMSUB`` for the subscriber, ``CLIENT LIST`` for the others), polled every half millisecond.
- **Redis and a client cut off by the network** (root, ``ip netns`` and veth): Redis in one network
  namespace, the subscriber in another, routed through a third; the route drops their packets both ways
  and nothing is closed. How long Redis still counts it: with Redis's default
  ``tcp-keepalive`` (300 s) for the whole observation, even after the process is SIGKILLed behind the cut
  (its FIN never arrives); with ``tcp-keepalive 3``, until the keepalive probes give up. Then a reset of
  Redis's side alone (``ss -K``, where the kernel has it) while the subscriber is cut off: Redis drops the
  subscription at once, and the subscriber's side learns of it only when it next sends. The cut is a
  route that drops packets in a third namespace between the two (``ip route add blackhole``): both
  ends' links stay up, as in a partition.

    python benchmarks/liveness_signals.py
    python benchmarks/liveness_signals.py --quick
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

# isort: split
import redis  # noqa: E402

from benchmarks.figures import spread  # noqa: E402
from tests.services import RedisServer  # noqa: E402

POLL = 0.0005  # seconds between two looks at Redis
# A process that holds ``MB`` megabytes (touched, so really held) and says when it is ready.
HOLDER = "import sys; b = b'x' * ({mb} << 20); print('ready', flush=True); sys.stdin.read()"
# A client of ``url`` that subscribes, blocks or idles under ``name``, then says so.
CLIENT = """
import sys, redis
conn = redis.Redis.from_url(sys.argv[1], socket_keepalive=False)
kind, name = sys.argv[2], sys.argv[3]
conn.client_setname(name)
if kind == "subscribe":
    sub = conn.pubsub()
    sub.subscribe(name)
    sub.get_message(timeout=5)  # the confirmation
    print("ready", flush=True)
    while True:
        sub.get_message(timeout=3600)
elif kind == "blpop":
    print("ready", flush=True)
    conn.blpop([name], 0)
else:
    print("ready", flush=True)
    sys.stdin.read()
"""


def kernel_at_least(major: int, minor: int) -> bool:
    found = platform.release().split(".")
    try:
        return (int(found[0]), int(found[1].split("-")[0])) >= (major, minor)
    except (IndexError, ValueError):
        return False


def started(command: list[str], **kwargs: Any) -> subprocess.Popen[str]:
    """A process that prints ``ready`` once it is set up; returned once it has."""
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if line.strip() != "ready":
        process.kill()
        raise RuntimeError(f"{command[:3]} did not start: {line!r}")
    return process


def killed(process: subprocess.Popen[str]) -> float:
    """SIGKILL ``process``; the moment it was sent (``time.monotonic``, the same clock in every process)."""
    at = time.monotonic()
    os.kill(process.pid, signal.SIGKILL)
    return at


# --- pidfd ------------------------------------------------------------------------------------------------

WATCHER = """
import os, select, sys, time
fd = os.pidfd_open(int(sys.argv[1]))
poller = select.poll()
poller.register(fd, select.POLLIN)
print("ready", flush=True)
poller.poll()
print(time.monotonic(), flush=True)
"""


def pidfd_trials(trials: int, mb: int) -> list[float]:
    """From SIGKILL of a process holding ``mb`` MB to a pidfd on it, which another process holds, being
    readable."""
    times = []
    for _ in range(trials):
        victim = started([sys.executable, "-c", HOLDER.format(mb=mb)])
        watcher = started([sys.executable, "-c", WATCHER, str(victim.pid)])
        at = killed(victim)
        assert watcher.stdout is not None
        seen = float(watcher.stdout.readline())
        times.append(seen - at)
        victim.wait(timeout=10)
        watcher.wait(timeout=10)
    return times


# --- Redis and a SIGKILLed client -------------------------------------------------------------------------


def counted(conn: redis.Redis[bytes], kind: str, name: str) -> bool:
    """Whether Redis still counts the client ``name``."""
    if kind == "subscribe":
        return bool(conn.pubsub_numsub(name)[0][1])
    return any(c.get("name") == name for c in conn.client_list())


def until_gone(conn: redis.Redis[bytes], kind: str, name: str, since: float, limit: float) -> float | None:
    """Seconds from ``since`` until Redis no longer counts ``name``; ``None`` if it still does after
    ``limit`` seconds."""
    while counted(conn, kind, name):
        if time.monotonic() - since > limit:
            return None
        time.sleep(POLL)
    return time.monotonic() - since


def redis_trials(server: RedisServer, kind: str, trials: int) -> list[float]:
    conn = server.client()
    times = []
    for i in range(trials):
        name = f"presence-{kind}-{i}"
        client = started([sys.executable, "-c", CLIENT, server.url(), kind, name])
        wait_until(functools.partial(counted, conn, kind, name), 5)  # BLPOP is sent after "ready"
        gone = until_gone(conn, kind, name, killed(client), 5)
        if gone is None:
            raise RuntimeError(f"Redis still counts a SIGKILLed {kind} client after 5 s")
        times.append(gone)
        client.wait(timeout=10)
    return times


def wait_until(condition: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out")
        time.sleep(POLL)


# --- Redis and a client cut off by the network ------------------------------------------------------------


def answers(conn: redis.Redis[bytes], sock: Path) -> bool:
    try:
        return sock.exists() and bool(conn.ping())
    except redis.ConnectionError:
        return False


def ip(*args: str, ns: str | None = None) -> subprocess.CompletedProcess[str]:
    command = ["ip", "netns", "exec", ns, *args] if ns else list(args)
    return subprocess.run(command, capture_output=True, text=True, check=True, timeout=30)


@dataclass(frozen=True)
class Network:
    """Redis's namespace and its client's, routed through a third, where a route can drop packets: a cut
    that closes nothing, as a partition, a frozen proxy or a dead NAT entry does."""

    server_ns: str
    client_ns: str
    router_ns: str
    server_address: str
    client_address: str

    def cut(self, *, toward_client: bool = True, toward_server: bool = True) -> None:
        for wanted, address in ((toward_client, self.client_address), (toward_server, self.server_address)):
            if wanted:
                ip("ip", "route", "add", "blackhole", f"{address}/32", ns=self.router_ns)

    def restore(self) -> None:
        for address in (self.client_address, self.server_address):
            subprocess.run(
                ["ip", "netns", "exec", self.router_ns, "ip", "route", "del", "blackhole", f"{address}/32"],
                capture_output=True,
            )


@contextlib.contextmanager
def network(tag: str) -> Iterator[Network]:
    """Three network namespaces: Redis's, its client's, and a router between them (veth pairs)."""
    names = [f"co-{tag}-{role}" for role in ("r", "c", "m")]
    subnet = 16 + int(tag) % 200
    net = Network(*names, f"10.213.{subnet}.1", f"10.214.{subnet}.2")  # type: ignore[call-arg]
    try:
        for name in names:
            ip("ip", "netns", "add", name)
            ip("ip", "link", "set", "lo", "up", ns=name)
        ip("sysctl", "-q", "-w", "net.ipv4.ip_forward=1", ns=net.router_ns)
        for side, ns, prefix in (("r", net.server_ns, "10.213"), ("c", net.client_ns, "10.214")):
            inside, outside = f"co{tag}{side}", f"co{tag}{side}m"
            ip(
                "ip",
                "link",
                "add",
                inside,
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                outside,
                "netns",
                net.router_ns,
            )
            ip("ip", "addr", "add", f"{prefix}.{subnet}.{1 if side == 'r' else 2}/24", "dev", inside, ns=ns)
            ip("ip", "addr", "add", f"{prefix}.{subnet}.254/24", "dev", outside, ns=net.router_ns)
            ip("ip", "link", "set", inside, "up", ns=ns)
            ip("ip", "link", "set", outside, "up", ns=net.router_ns)
            ip("ip", "route", "add", "default", "via", f"{prefix}.{subnet}.254", ns=ns)
        yield net
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


def namespaces_possible() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("redis-server") is None:
        return False
    probe = subprocess.run(["ip", "netns", "add", f"co-probe-{os.getpid()}"], capture_output=True)
    subprocess.run(["ip", "netns", "delete", f"co-probe-{os.getpid()}"], capture_output=True)
    return probe.returncode == 0


@contextlib.contextmanager
def redis_in(net: Network, directory: Path, keepalive: int) -> Iterator[redis.Redis[bytes]]:
    """A Redis server in the server namespace; a client of it over a unix socket, which no cut touches."""
    sock = directory / f"redis-{keepalive}.sock"
    server = subprocess.Popen(
        ["ip", "netns", "exec", net.server_ns, "redis-server", "--port", "6390",
         "--bind", net.server_address, "--unixsocket", str(sock), "--save", "", "--appendonly", "no",
         "--protected-mode", "no", "--tcp-keepalive", str(keepalive)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        conn = redis.Redis(unix_socket_path=str(sock), socket_timeout=2)
        wait_until(functools.partial(answers, conn, sock), 10)
        yield conn
    finally:
        server.kill()
        server.wait(timeout=10)


def subscriber(net: Network, channel: str) -> subprocess.Popen[str]:
    url = f"redis://{net.server_address}:6390/0"
    command = ["ip", "netns", "exec", net.client_ns, sys.executable, "-c", CLIENT, url, "subscribe", channel]
    client = started(command)
    # Idle, as a presence connection is: nothing unacknowledged either way (a segment in flight is
    # retransmitted for up to tcp_retries2, about fifteen minutes, instead of probed by keepalives).
    time.sleep(0.3)
    return client


def cut_off(observe: float) -> dict[str, Any]:
    """A subscriber behind a cut: how long Redis counts it with the default keepalive, once it was killed
    behind the cut, with a short keepalive; and a reset of Redis's side that the subscriber never hears."""
    tag = str(os.getpid() % 100_000)
    tmp = Path(tempfile.mkdtemp(prefix="celery-orphans-liveness-"))
    found: dict[str, Any] = {}
    try:
        with network(tag) as net:
            with redis_in(net, tmp, 300) as conn:
                client = subscriber(net, "presence")
                net.cut()
                held = until_gone(conn, "subscribe", "presence", time.monotonic(), observe)
                found["default_keepalive_dropped_after_s"] = held
                found["observed_s"] = observe
                at = killed(client)  # dead behind the cut: its kernel's FIN cannot reach Redis
                dead = until_gone(conn, "subscribe", "presence", at, observe)
                found["killed_behind_cut_dropped_after_s"] = dead
                net.restore()  # the dead client's kernel sends its FIN again, and it arrives
                found["killed_dropped_once_restored_after_s"] = until_gone(
                    conn, "subscribe", "presence", time.monotonic(), 30
                )
                client.wait(timeout=10)
            with redis_in(net, tmp, 3) as conn:
                client = subscriber(net, "presence")
                net.cut()
                found["keepalive_3_dropped_after_s"] = until_gone(
                    conn, "subscribe", "presence", time.monotonic(), 20
                )
                net.restore()
                client.kill()
                client.wait(timeout=10)
                found.update(one_sided_reset(conn, net))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return found


def one_sided_reset(conn: redis.Redis[bytes], net: Network) -> dict[str, Any]:
    """Reset Redis's side of a subscriber's connection while the subscriber is cut off: what each sees."""
    client = subscriber(net, "reset")
    net.cut()
    reset = subprocess.run(
        ["ip", "netns", "exec", net.server_ns, "ss", "-K", "dst", net.client_address],
        capture_output=True,
        text=True,
    )
    gone = until_gone(conn, "subscribe", "reset", time.monotonic(), 2)
    net.restore()
    time.sleep(1.0)
    unaware = client.poll() is None  # its subscription loop would have ended on a closed connection
    client.kill()
    client.wait(timeout=10)
    return {
        "reset_available": reset.returncode == 0 and gone is not None,
        "reset_dropped_after_s": gone,
        "subscriber_unaware_after_restore": unaware,
    }


# --- the run ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CI size: fewer trials, shorter observations")
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--observe", type=float, default=10.0, help="seconds a cut-off client is watched")
    parser.add_argument(
        "--json", type=Path, default=ROOT / "benchmarks" / "results" / "liveness_signals.json"
    )
    args = parser.parse_args()
    if args.quick:
        args.trials, args.observe = 5, 3.0
    results: dict[str, Any] = {"kernel": platform.release(), "load_before": os.getloadavg()}

    if hasattr(os, "pidfd_open") and kernel_at_least(5, 3):
        for mb in (0, 100, 1000):
            times = pidfd_trials(args.trials, mb)
            results[f"pidfd_{mb}mb"] = spread(times) | {"n": len(times)}
            print(f"pidfd readable after SIGKILL, {mb} MB held: {_ms(results[f'pidfd_{mb}mb'])}", flush=True)
    else:
        print(f"pidfd skipped: kernel {platform.release()} or Python lacks os.pidfd_open", flush=True)

    tmp = Path(tempfile.mkdtemp(prefix="celery-orphans-liveness-"))
    server = RedisServer(tmp / "redis").start()
    try:
        for kind in ("subscribe", "blpop", "named"):
            times = redis_trials(server, kind, args.trials)
            results[f"redis_{kind}"] = spread(times) | {"n": len(times)}
            print(
                f"Redis stops counting a SIGKILLed {kind} client: {_ms(results[f'redis_{kind}'])}", flush=True
            )
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    if namespaces_possible():
        cut = results["cut_off"] = cut_off(args.observe)
        print(
            f"a subscriber cut off (packets dropped both ways, nothing closed): Redis dropped it after "
            f"{_s(cut['default_keepalive_dropped_after_s'], cut['observed_s'])} (tcp-keepalive 300); once "
            "SIGKILLed behind the cut, after "
            f"{_s(cut['killed_behind_cut_dropped_after_s'], cut['observed_s'])}, "
            f"and {_s(cut['killed_dropped_once_restored_after_s'], 30)} after the cut was lifted; "
            f"with tcp-keepalive 3, after {_s(cut['keepalive_3_dropped_after_s'], 20)}",
            flush=True,
        )
        if cut["reset_available"]:
            print(
                f"Redis's side reset while the subscriber is cut off: Redis dropped it after "
                f"{_s(cut['reset_dropped_after_s'], 2)}; the subscriber, which sends nothing, "
                f"{'had not noticed' if cut['subscriber_unaware_after_restore'] else 'had noticed'} "
                "a second after the cut was lifted",
                flush=True,
            )
        else:
            print(
                "a reset of Redis's side alone: skipped (ss -K is not available in this kernel)", flush=True
            )
    else:
        print("a client cut off by the network: skipped (needs root, ip netns and veth)", flush=True)
    results["load_after"] = os.getloadavg()
    print(f"load {results['load_before'][0]:.2f} -> {results['load_after'][0]:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))


def _ms(figure: dict[str, float]) -> str:
    low, mid, high = (figure[k] * 1000 for k in ("min", "median", "max"))
    return f"median {mid:.2f} ms (min {low:.2f}, max {high:.2f}, n={figure['n']:.0f})"


def _s(seconds: float | None, observed: float) -> str:
    return f"never within {observed:g} s" if seconds is None else f"{seconds:.2f} s"


if __name__ == "__main__":
    main()
