"""The ledger's ceiling: how many recoverable tasks one Redis core carries through the ledger.

Every recoverable task costs the ledger's Redis its admission (the entry written before the task runs) and
its release (the entry removed once it is acknowledged), nothing else. This drives exactly those calls,
as the worker's main process issues them, from several client processes at once, pipelined, so that
Redis and not Python is the bottleneck; then it reads Redis's own accounts:

- **Redis CPU** (``INFO cpu``: ``used_cpu_sys`` + ``used_cpu_user``, before and after): tasks per
  Redis-core-second is the tasks carried over the CPU seconds Redis spent carrying them, whatever share
  of a core that was;
- **commands per task** (``INFO commandstats``): the calls the clients made, and every command Redis ran,
  those inside the scripts included;
- **bytes per task** (``INFO stats``: ``total_net_input_bytes``, ``total_net_output_bytes``).

What is sent is what the ledger's own code builds: each command is made by ``Ledger.send_admit`` (the
outbox's write of a first-hand delivery) or ``Ledger.release_many`` (its flush of removals) against a
stand-in connection that keeps the bytes instead of sending them, then those bytes are sent to the real
server, many commands at a time. The entry is the one a worker records for a real Celery task message,
taken from the broker as the worker gets it. Two patterns:

- **busy** (judged): a worker whose next task comes before its last one's removal is flushed: the removal
  rides on the next admission, one script call per task (``outbox.py``);
- **idle**: a worker whose tasks come more than ``FLUSH_DELAY_SECONDS`` apart: an admission, then a
  removal of its own, two calls per task.

The ledger holds ``--inflight`` entries of running tasks throughout, as a busy fleet's does. Each busy
and idle run is also made one command at a time per connection (``depth 1``), as many workers each
sending one command reach Redis: more system calls per command, for information.

For scale, the same figures for the **broker**: a Celery task message published, consumed and
acknowledged through kombu's Redis transport (``acks_late`` and a prefetch of one, as the recommended
settings have it) on a Redis server of its own, from several publishing and consuming processes.

Target: at least 20,000 recoverable tasks per Redis-core-second (busy, pipelined). Each figure is the
median of ``--runs`` runs (at least 5), with the minimum and maximum.

    python benchmarks/ledger_ceiling.py
    python benchmarks/ledger_ceiling.py --quick
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import selectors
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

# isort: split
# An entry is sealed (an HMAC tag over its JSON) with the signing key, which the Django settings hold;
# the ledger's servers here are the benchmark's own, so a key of its own is all it needs.
import django  # noqa: E402
from django.conf import settings as django_settings  # noqa: E402

if not django_settings.configured:
    django_settings.configure(SECRET_KEY="ledger-ceiling-benchmark-" + uuid.uuid4().hex, USE_TZ=True)
    django.setup()

# isort: split
import hiredis  # noqa: E402
import redis  # noqa: E402
from celery import Celery  # noqa: E402
from kombu import Connection, Consumer, Exchange, Queue  # noqa: E402

from benchmarks.figures import counters, per_task, spread  # noqa: E402
from celery_orphans.entry import Entry, delivery_from_message  # noqa: E402
from celery_orphans.ledger import Ledger  # noqa: E402
from celery_orphans.scripts import ADMIT, RELEASE_MANY  # noqa: E402
from celery_orphans.store import Keys  # noqa: E402
from tests.services import RedisServer  # noqa: E402

TARGET = 20_000  # recoverable tasks per Redis-core-second
MIN_RUNS = 5
LEASE_SECONDS = 3600  # the workers' leases outlast every run (hold_leases)
KEYS = Keys("celery_orphans")
QUEUE = "ceiling"
TASK_NAME = "demoapp.summarize"  # what the entry's message runs; no worker runs it here
CYCLE = 2_000  # distinct tasks per client, sent over and over (see commands())
FORK = multiprocessing.get_context("fork")


# --- what Redis says -------------------------------------------------------------------------------------


def snapshot(conn: redis.Redis[bytes]) -> dict[str, float]:
    """Redis's counters now (``figures.counters``)."""
    return counters(conn.info("commandstats"), conn.info("cpu"), conn.info("stats"))


# --- the ledger's own commands ----------------------------------------------------------------------------


class Recorder(redis.Redis):  # type: ignore[type-arg]
    """Stands in for the ledger's client and the outbox's connection: keeps each command the ledger would
    send, packed as redis-py packs it, and answers as Redis would to a write that went through."""

    def __init__(self) -> None:
        super().__init__()  # a client that never connects
        self.packer = redis.connection.Connection()
        self.sent: list[bytes] = []

    def send_command(self, *args: Any, **kwargs: Any) -> None:  # the outbox's connection
        self.sent.append(b"".join(self.packer.pack_command(*args)))

    def execute_command(self, *args: Any, **options: Any) -> Any:  # the ledger's client
        self.send_command(*args)
        return 1


def real_delivery(broker_url: str) -> Any:
    """The delivery a worker records for a recoverable task: a Celery message taken from the broker."""
    app = Celery("ceiling", broker=broker_url, set_as_current=False)
    app.conf.update(task_serializer="json", accept_content=["json"], result_extended=True)
    queue = Queue(QUEUE, Exchange(QUEUE), routing_key=QUEUE)
    app.send_task(TASK_NAME, args=([3, 1, 4, 1, 5, 9, 2, 6],), kwargs={"seconds": 0}, queue=queue)
    with Connection(broker_url) as conn:
        got: list[Any] = []
        with Consumer(conn, [queue], callbacks=[lambda _body, message: got.append(message)], accept=["json"]):
            conn.drain_events(timeout=10)
        got[0].ack()
        return delivery_from_message(got[0])


def entries(delivery: Any, node: str, count: int) -> list[Entry]:
    """``count`` entries of one worker boot, each a task of its own (the message's id is the task's)."""
    boot = uuid.uuid4().hex
    made = []
    for i in range(count):
        task_id = str(uuid.uuid4())
        headers = {**delivery.headers, "id": task_id, "root_id": task_id}
        properties = {**delivery.properties, "correlation_id": task_id}
        d = dataclasses.replace(
            delivery, headers=headers, properties=properties, delivery_tag=str(uuid.uuid4())
        )
        made.append(Entry(task_id, TASK_NAME, node, boot, time.time(), d, token=f"{boot}.{i:x}"))
    return made


@dataclasses.dataclass(frozen=True)
class Ring:
    """One worker's commands, sent round and round, and for each of its tasks the removal its outbox
    sends on its own when no task follows (sent once the run stops, so the ledger ends as it began)."""

    sent: list[bytes]
    flush: list[bytes]
    lease: str  # the worker boot's lease key, which must exist for its admissions to be written


def commands(pattern: str, made: list[Entry]) -> Ring:
    """The bytes the worker sends for each task of ``made``, in order: ``busy`` one admission carrying the
    previous task's removal, ``idle`` an admission then a removal of its own.

    The tasks are sent over and over: the n-th round admits each task again long after its removal, which
    costs Redis what a new task id would.
    """
    recorder, flusher = Recorder(), Recorder()
    ledger = Ledger(recorder, KEYS)
    lease = KEYS.lease(made[0].node, made[0].boot)
    for i, entry in enumerate(made):
        if pattern == "busy":
            previous = made[i - 1]
            ledger.send_admit(recorder, entry, [(previous.task_id, previous.token)], lease)
            Ledger(flusher, KEYS).release_many([(entry.task_id, entry.token)])
        else:
            ledger.send_admit(recorder, entry, [], lease)
            ledger.release_many([(entry.task_id, entry.token)])
    return Ring(recorder.sent, flusher.sent, lease)


# --- the clients ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Load:
    pattern: str  # busy, idle
    depth: int  # commands in flight per connection
    connections: int  # per client process
    seconds: float
    pace: float = 0.0  # tasks per second per connection; 0: as fast as Redis answers


def client(port: int, rings: list[Ring], load: Load, start: Any, done: Any, results: Any, calls: int) -> None:
    """Send each ring of commands round and round on a connection of its own, ``load.depth`` in flight,
    from the moment ``start`` is set for ``load.seconds``; put (tasks, errors) in ``results``.

    A connection is one worker's main process: its removals follow their admissions on it, in order.
    ``calls`` is the number of commands per task; a run stops at a task's end.
    """
    selector = selectors.DefaultSelector()
    state: dict[socket.socket, dict[str, Any]] = {}
    for ring in rings:
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        state[sock] = {
            "ring": ring.sent,
            "flush": ring.flush,
            "reader": hiredis.Reader(),
            "owed": 0,
            "next": 0,
            "sent": 0,
        }
        selector.register(sock, selectors.EVENT_READ)
    replies = errors = 0

    def send(sock: socket.socket, count: int) -> None:
        s = state[sock]
        ring, first = s["ring"], s["next"]
        sock.sendall(b"".join(ring[(first + j) % len(ring)] for j in range(count)))
        s["next"] = (first + count) % len(ring)
        s["owed"] += count
        s["sent"] += count

    start.wait()
    began = time.monotonic()
    deadline = began + load.seconds
    for sock in state:
        send(sock, load.depth)
    while any(s["owed"] for s in state.values()):
        for key, _ in selector.select(timeout=5):
            sock = key.fileobj  # type: ignore[assignment]
            s = state[sock]
            data = sock.recv(1 << 20)
            if not data:
                raise ConnectionError("Redis closed the connection")
            s["reader"].feed(data)
            got = 0
            while (reply := s["reader"].gets()) is not False:
                got += 1
                if not done_as_asked(reply):
                    errors += 1
            s["owed"] -= got
            replies += got
            if load.pace and got:
                # The next task when it is due; an idle task's removal follows its admission at once.
                due = began + (s["sent"] // calls) / load.pace
                time.sleep(max(0.0, due - time.monotonic()) if s["next"] % calls == 0 else 0.0)
            if time.monotonic() >= deadline:
                got = -s["next"] % calls  # only what finishes the task begun
            if got:
                send(sock, got)
    for sock, s in state.items():
        if s["flush"]:  # the last task's removal, which no next admission carries
            sock.sendall(s["flush"][(s["next"] - 1) % len(s["flush"])])
            reader = s["reader"]
            while (reply := reader.gets()) is False:
                reader.feed(sock.recv(1 << 16))
        sock.close()
    results.put((replies // calls, errors))
    done.set()


def done_as_asked(reply: Any) -> bool:
    """Whether the ledger did what the worker asked: an admission answers ``[1, ...]`` when it wrote the
    entry (``4``: refused, its boot's lease is gone), a release the number of entries it removed (one)."""
    if isinstance(reply, list):
        return bool(reply[0] == 1)
    return not isinstance(reply, hiredis.ReplyError) and reply == 1


def run_load(
    server: RedisServer, conn: redis.Redis[bytes], load: Load, rings: list[list[Ring]]
) -> dict[str, Any]:
    """One run of ``load``: every client process sends its rings; Redis's accounts before and after."""
    calls = 1 if load.pattern == "busy" else 2
    start = FORK.Event()
    results = FORK.Queue()
    dones = [FORK.Event() for _ in rings]
    procs = [
        FORK.Process(target=client, args=(server.port, each, load, start, done, results, calls))
        for each, done in zip(rings, dones)
    ]
    for p in procs:
        p.start()
    time.sleep(0.3)  # connected and waiting
    before = snapshot(conn)
    began = time.monotonic()
    start.set()
    for done in dones:
        if not done.wait(load.seconds + 30):
            raise RuntimeError("a client did not finish")
    took = time.monotonic() - began
    after = snapshot(conn)
    counts = [results.get(timeout=10) for _ in procs]
    for p in procs:
        p.join(timeout=10)
    tasks, errors = sum(c[0] for c in counts), sum(c[1] for c in counts)
    if errors:
        raise RuntimeError(f"{errors} of the ledger's calls failed or were refused")
    figures = per_task(before, after, tasks)
    figures["wall_tasks_per_second"] = tasks / took
    figures["redis_cpu_share"] = figures["redis_cpu_seconds"] / took
    return figures


def send_all(port: int, sent: list[bytes]) -> list[Any]:
    """Send every command at once on a connection of its own; Redis's replies, in order."""
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"".join(sent))
        reader, replies = hiredis.Reader(), []
        while len(replies) < len(sent):
            data = sock.recv(1 << 20)
            if not data:
                raise ConnectionError("Redis closed the connection")
            reader.feed(data)
            while (reply := reader.gets()) is not False:
                replies.append(reply)
    return replies


def ledger_runs(
    server: RedisServer, delivery: Any, loads: list[Load], runs: int, clients: int, inflight: int
) -> dict[str, Any]:
    """Every ``load``, ``runs`` times, with ``clients`` client processes; the ledger holds ``inflight``
    entries of running tasks throughout."""
    conn = server.client()
    conn.script_load(ADMIT)
    conn.script_load(RELEASE_MANY)
    held_ring = commands("idle", entries(delivery, "running@bench", inflight)) if inflight else None
    # One ring of tasks per connection (a worker's main process), per client process, per load shape.
    made = {
        (pattern, connections): [
            [
                commands(pattern, entries(delivery, f"ceiling-{c}-{n}@bench", CYCLE))
                for n in range(connections)
            ]
            for c in range(clients)
        ]
        for pattern, connections in sorted({(load.pattern, load.connections) for load in loads})
    }
    rings = [ring for per_load in made.values() for per_client in per_load for ring in per_client]
    leases = hold_leases(conn, [ring.lease for ring in rings + ([held_ring] if held_ring else [])])
    used = conn.info("memory")["used_memory"]
    # The first round's admissions of the held entries: (its removals find nothing to remove).
    held = held_ring.sent[::2] if held_ring else []
    if not all(done_as_asked(r) for r in send_all(server.port, held)):
        raise RuntimeError("the ledger refused an entry")
    memory_per_entry = (conn.info("memory")["used_memory"] - used) / max(1, inflight)
    held_now = int(conn.zcard(KEYS.inflight))
    out: dict[str, Any] = {}
    if inflight:
        out["inflight"] = inflight
        out["entry_json_bytes"] = len(entries(delivery, "x@bench", 1)[0].to_json())
        out["memory_per_entry_bytes"] = memory_per_entry
    for load in loads:
        label = f"{load.pattern}, depth {load.depth}" + (", paced" if load.pace else "")
        figures = []
        for i in range(runs):
            figures.append(run_load(server, conn, load, made[load.pattern, load.connections]))
            f = figures[-1]
            print(
                f"  ledger {label}, run {i + 1}: {f['tasks_per_core_second']:,.0f} tasks per Redis-core-s "
                f"({f['wall_tasks_per_second']:,.0f} tasks/s, Redis CPU {f['redis_cpu_share']:.0%}), "
                f"{f['commands_per_task']:.1f} commands and {f['bytes_in_per_task']:,.0f} B in per task",
                flush=True,
            )
        out[label] = summarize_runs(figures)
    # Every entry of the loads went with its removal.
    out["entries_left"] = int(conn.zcard(KEYS.inflight)) - held_now
    if conn.exists(*leases) != len(leases):
        raise RuntimeError("a worker's lease lapsed during the runs")
    conn.delete(*leases)
    return out


def hold_leases(conn: redis.Redis[bytes], leases: list[str]) -> list[str]:
    """Write each worker boot's lease, as its heartbeat takes it, for as long as the runs last.

    The admission script writes no entry for a boot whose lease is gone (``writer_gone``, answer 4): the
    sweep would judge that boot dead. A live worker's heartbeat renews its lease (``redis_cost.py``
    measures that: a cost per worker and per second, not per task), so here each lease is written once,
    before Redis's counters are read, with a lifetime no run outlasts; ``ledger_runs`` checks they are all
    still there at the end. Every admission a run counts was written, every release removed its entry.
    """
    with conn.pipeline(transaction=False) as pipe:
        for lease in leases:
            pipe.set(lease, "ledger-ceiling", ex=LEASE_SECONDS)
        pipe.execute()
    return leases


def summarize_runs(figures: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's minimum, median and maximum over the runs, and the median run's commands."""
    numbers = [k for k, v in figures[0].items() if isinstance(v, (int, float))]
    middle = sorted(figures, key=lambda f: f["tasks_per_core_second"])[len(figures) // 2]
    return {
        **{k: spread([f[k] for f in figures]) for k in numbers},
        "by_command": middle["by_command"],
        "runs": len(figures),
    }


# --- the broker, for scale ------------------------------------------------------------------------------


def publisher(broker_url: str, message: dict[str, Any], count: int, start: Any, done: Any) -> None:
    """Publish ``count`` copies of a Celery task message (each its own id), as ``send_task`` does."""
    with Connection(broker_url) as conn:
        producer = conn.Producer()
        start.wait()
        for _ in range(count):
            task_id = str(uuid.uuid4())
            producer.publish(
                message["body"],
                exchange="",
                routing_key=QUEUE,
                serializer="json",
                headers={**message["headers"], "id": task_id, "root_id": task_id},
                correlation_id=task_id,
                delivery_mode=2,
                priority=0,
                reply_to=message["reply_to"],
            )
    done.set()


def consumer(broker_url: str, count: int, start: Any, done: Any, results: Any) -> None:
    """Consume and acknowledge ``count`` messages, one at a time (``acks_late``, a prefetch of one)."""
    got = 0

    def handle(_body: object, message: Any) -> None:
        nonlocal got
        message.ack()
        got += 1

    with Connection(broker_url, transport_options={"visibility_timeout": 3600}) as conn:
        queue = Queue(QUEUE, Exchange(""), routing_key=QUEUE)
        with Consumer(conn, [queue], callbacks=[handle], accept=["json"], prefetch_count=1):
            start.wait()
            while got < count:
                try:
                    conn.drain_events(timeout=10)
                except TimeoutError:
                    break
    results.put(got)
    done.set()


def broker_run(server: RedisServer, message: dict[str, Any], tasks: int, procs: int) -> dict[str, Any]:
    """``tasks`` messages published by ``procs`` processes and consumed by as many, at once."""
    conn = server.client()
    url = server.url()
    start, results = FORK.Event(), FORK.Queue()
    each = tasks // procs
    published, consumed = [FORK.Event() for _ in range(procs)], [FORK.Event() for _ in range(procs)]
    workers = [FORK.Process(target=consumer, args=(url, each, start, done, results)) for done in consumed] + [
        FORK.Process(target=publisher, args=(url, message, each, start, done)) for done in published
    ]
    for w in workers:
        w.start()
    time.sleep(1.0)  # connected and consuming (kombu restores what a dead consumer left, at its start)
    before = snapshot(conn)
    began = time.monotonic()
    start.set()
    for done in consumed + published:
        if not done.wait(120):
            raise RuntimeError("the broker run did not finish")
    took = time.monotonic() - began
    after = snapshot(conn)
    carried = sum(results.get(timeout=10) for _ in range(procs))
    for w in workers:
        w.join(timeout=10)
    if carried != each * procs:
        raise RuntimeError(f"{each * procs} messages published, {carried} consumed")
    figures = per_task(before, after, carried)
    figures["wall_tasks_per_second"] = carried / took
    figures["redis_cpu_share"] = figures["redis_cpu_seconds"] / took
    # Every command a broker client sends is a call of its own (MULTI and EXEC included).
    figures["calls_per_task"] = figures["commands_per_task"]
    return figures


def celery_message(broker_url: str) -> dict[str, Any]:
    """The body, headers and reply address of a Celery task message, as ``send_task`` makes them."""
    app = Celery("ceiling", broker=broker_url, set_as_current=False)
    app.conf.update(task_serializer="json", accept_content=["json"])
    made = app.amqp.as_task_v2(str(uuid.uuid4()), TASK_NAME, ([3, 1, 4, 1, 5, 9, 2, 6],), {"seconds": 0})
    return {"body": made.body, "headers": dict(made.headers), "reply_to": str(uuid.uuid4())}


# --- the run ----------------------------------------------------------------------------------------------


def verdict(passed: bool | None) -> str:
    return "n/a" if passed is None else "PASS" if passed else "FAIL"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="CI size: shorter runs")
    parser.add_argument("--runs", type=int, default=MIN_RUNS, help=f"runs of each load (at least {MIN_RUNS})")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each ledger run")
    parser.add_argument("--clients", type=int, default=3, help="client processes")
    parser.add_argument("--depth", type=int, default=64, help="commands in flight per connection, pipelined")
    parser.add_argument("--inflight", type=int, default=10_000, help="entries of running tasks held")
    parser.add_argument("--broker-tasks", type=int, default=10_000, help="messages per broker run")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "results" / "ledger_ceiling.json")
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.inflight, args.broker_tasks = 1.0, 2_000, 4_000
    loads = [
        Load("busy", args.depth, 1, args.seconds),
        Load("idle", args.depth, 1, args.seconds),
        Load("busy", 1, 8, args.seconds),
        Load("idle", 1, 8, args.seconds),
    ]
    tmp = Path(tempfile.mkdtemp(prefix="celery-orphans-ceiling-"))
    # Two servers of its own, so that every command each serves is the workload's.
    ledger_server = RedisServer(tmp / "ledger").start()
    broker_server = RedisServer(tmp / "broker").start()
    load_before = os.getloadavg()
    try:
        delivery = real_delivery(broker_server.url())
        print(
            f"ledger: {args.clients} client processes, {args.seconds:g} s a run, {args.inflight:,} entries "
            f"held; load {load_before[0]:.2f}",
            flush=True,
        )
        ledger = ledger_runs(ledger_server, delivery, loads, args.runs, args.clients, args.inflight)
        message = celery_message(broker_server.url())
        broker_figures = []
        for i in range(args.runs):
            broker_figures.append(broker_run(broker_server, message, args.broker_tasks, 2))
            f = broker_figures[-1]
            print(
                f"  broker, run {i + 1}: {f['tasks_per_core_second']:,.0f} tasks per Redis-core-second "
                f"({f['wall_tasks_per_second']:,.0f} tasks/s, Redis CPU {f['redis_cpu_share']:.0%}), "
                f"{f['commands_per_task']:.1f} commands and {f['bytes_in_per_task']:,.0f} B in per task",
                flush=True,
            )
        broker = summarize_runs(broker_figures)
        # The ledger at the broker's own pace, from as many processes as consumed: what it adds to a
        # Redis that is no busier than the broker's was.
        rate = broker["wall_tasks_per_second"]["median"]
        paced = Load("busy", 1, 1, args.seconds, pace=rate / 2)
        print(f"ledger at the broker's pace, {rate:,.0f} tasks/s:", flush=True)
        at_pace = ledger_runs(ledger_server, delivery, [paced], args.runs, 2, 0)
        ledger["entries_left"] += at_pace.pop("entries_left")
        ledger.update(at_pace)
    finally:
        ledger_server.stop()
        broker_server.stop()
    headline = ledger[f"busy, depth {args.depth}"]
    rate = headline["tasks_per_core_second"]["median"]
    judged = rate >= TARGET if args.runs >= MIN_RUNS else None
    results = {
        "target_tasks_per_core_second": TARGET,
        "ledger": ledger,
        "broker": broker,
        "headline": f"busy, depth {args.depth}",
        "pass": judged,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "settings": vars(args) | {"json": str(args.json)},
    }
    print()
    for label in [name for name in ledger if ", depth " in name]:
        print(f"ledger {label}: {describe(ledger[label])}")
    print(f"broker (publish, consume, ack): {describe(broker)}")
    print(
        f"an entry: {ledger['entry_json_bytes']:,} B of JSON, {ledger['memory_per_entry_bytes']:,.0f} B of "
        f"Redis memory while its task runs; entries left: {ledger['entries_left']}"
    )
    print(f"ledger ceiling >= {TARGET:,} tasks per Redis-core-second: {rate:,.0f}  {verdict(judged)}")
    print(f"load {results['load_before'][0]:.2f} -> {results['load_after'][0]:.2f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=2))


def describe(r: Mapping[str, Any]) -> str:
    """One line of a load's medians: its rate per Redis core, and what each task cost Redis."""

    def m(name: str) -> float:
        return float(r[name]["median"])

    rate = r["tasks_per_core_second"]
    return (
        f"{m('tasks_per_core_second'):,.0f} (min {rate['min']:,.0f}, max {rate['max']:,.0f}) tasks per "
        f"Redis-core-second; per task {m('calls_per_task'):.1f} calls, "
        f"{m('commands_per_task'):.1f} commands, "
        f"{m('bytes_in_per_task'):,.0f} B in, {m('bytes_out_per_task'):,.0f} B out, "
        f"{m('redis_cpu_us_per_task'):.1f} us of Redis CPU "
        f"({m('executing_us_per_task'):.1f} us executing) at "
        f"{m('wall_tasks_per_second'):,.0f} tasks/s, Redis CPU {m('redis_cpu_share'):.0%}"
    )


if __name__ == "__main__":
    main()
