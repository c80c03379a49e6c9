"""Evidence that a worker is alive: one ``query_task`` broadcast, plus the leases in Redis."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping

import redis
from celery import Celery
from kombu import Connection, Consumer
from kombu.message import Message
from kombu.pidbox import Mailbox
from kombu.utils.uuid import uuid

from celery_orphans import leases, logs
from celery_orphans.observations import WorkerView
from celery_orphans.rules import worth_asking

logger = logs.get(__name__)


def ask_workers(
    app: Celery,
    nodes: Collection[str],
    task_ids: Collection[str],
    timeout: float,
) -> dict[str, frozenset[str]]:
    """Which of ``task_ids`` each node holds, for the nodes that answered; asked about no id, a node
    still answers, which says it is alive.

    One ``query_task`` broadcast to an explicit destination list, and every named node has ``timeout``
    seconds from the moment it is sent to answer: the wait ends as soon as every node has replied, or
    when that time is up. (Celery's ``inspect`` starts its wait over with each reply: twenty live
    workers answering one after another and one dead worker cost the timeout after the last reply.)
    """
    question = _Question(app, sorted(nodes), sorted(task_ids), timeout)
    try:
        return question.ask()
    except _BrokerLost as lost:
        # A pooled broker connection that the broker dropped: once more, on a connection of our own
        # (emptying the shared pool instead would leave later acquires waiting for ever).
        logger.info("broker connection lost while asking workers (%s); retrying", lost.__cause__)
        with app.connection_for_write() as conn:
            return question.ask(conn)


class _BrokerLost(Exception):
    pass


class _Question:
    """One ``query_task`` broadcast and the replies to it."""

    def __init__(
        self,
        app: Celery,
        destination: list[str],
        task_ids: list[str],
        timeout: float,
    ) -> None:
        self.app, self.destination, self.task_ids, self.timeout = app, destination, task_ids, timeout
        self.expected = frozenset(destination)
        self.held: dict[str, frozenset[str]] = {}
        self.broken: BaseException | None = None

    def ask(self, conn: Connection | None = None) -> dict[str, frozenset[str]]:
        if not self.destination:
            return {}
        errors = self.app.connection_for_write().connection_errors
        # What Celery's broadcast does (kombu's Mailbox: the question, then the replies on the reply
        # queue it declares), with one deadline for the whole wait instead of one per reply.
        with self.app.connection_or_acquire(conn) as connection:
            mailbox: Mailbox = self.app.control.mailbox(connection)  # type: ignore[attr-defined]
            ticket = uuid()
            try:
                mailbox._publish(
                    "query_task",
                    {"ids": self.task_ids},
                    destination=self.destination,
                    reply_ticket=ticket,
                    channel=connection.default_channel,
                    timeout=self.timeout,
                )
            except errors as exc:
                raise _BrokerLost from exc
            self._gather(connection, mailbox, ticket, time.monotonic() + self.timeout)
            if conn is None and isinstance(self.broken, errors):
                # A pooled connection the broker dropped goes back to the pool with a new transport:
                # kombu's virtual transport remembers the bindings it declared and skips declaring one it
                # remembers, even once the broker lost it (a Redis restart or failover), and the replies
                # to a later question whose reply queue has the same name would then be dropped.
                connection.collect()
        if isinstance(self.broken, errors):
            raise _BrokerLost from self.broken
        if self.broken is not None:
            raise self.broken
        return self.held

    def _gather(self, connection: Connection, mailbox: Mailbox, ticket: str, deadline: float) -> None:
        def on_reply(body: object, message: Message) -> None:
            if message.headers.get("ticket") == ticket and isinstance(body, dict):
                for node, held in body.items():
                    self.held[node] = frozenset(held) if isinstance(held, dict) else frozenset()

        channel = connection.default_channel
        consumer = Consumer(channel, [mailbox.reply_queue], accept=mailbox.accept, no_ack=True)
        consumer.register_callback(on_reply)
        self.broken = None
        try:
            with consumer:
                while not self.held.keys() >= self.expected:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        connection.drain_events(timeout=remaining)
                    except TimeoutError:
                        break
        except BaseException as exc:  # raised again once the reply queue is cleaned up
            self.broken = exc
        finally:
            # Always, as kombu's own Mailbox._collect does: otherwise the reply queue's binding stays
            # recorded in the connection's transport, and a later question whose reply queue has the same
            # name (kombu names it by process, thread and the address of a short-lived object, which
            # CPython reuses) would not bind it again.
            try:
                channel.after_reply_message_received(mailbox.reply_queue.name)
            except BaseException as exc:
                if self.broken is None:
                    self.broken = exc


def observe(
    app: Celery,
    nodes: Collection[str],
    ask: Mapping[str, Collection[str]],
    timeout: float,
    conn: redis.Redis[bytes] | None = None,
) -> dict[str, WorkerView]:
    """A ``WorkerView`` for every node: its fresh leases, and for the nodes in ``ask`` worth asking
    (``rules.worth_asking``: any but a node whose every boot was seen to exit), its answer to one
    broadcast about the ids ``ask`` lists for it. No node to ask: no broadcast at all.

    Leases are read before the broadcast and again after it for the nodes that stayed silent, and a
    lease seen fresh either time counts: a heartbeat held up by a Redis pause lands the moment Redis
    answers again, inside the broadcast's wait, so a live worker is not judged by that gap.
    """
    everyone = set(nodes) | set(ask)
    before = leases.boot_states(everyone, conn, prune=False)
    asking = {
        node: ids
        for node, ids in ask.items()
        if worth_asking(before[node].alive, before[node].gone, before[node].exited)
    }
    question = frozenset().union(*asking.values()) if asking else frozenset()
    held = ask_workers(app, asking, question, timeout) if asking else {}
    silent = [node for node in asking if node not in held]
    after = leases.boot_states(silent, conn, prune=False) if silent else {}
    views = {}
    for node in everyone:
        alive = before[node].alive | (after[node].alive if node in after else frozenset())
        views[node] = WorkerView(
            replied=node in held,
            held=held.get(node, frozenset()),
            fresh_boots=alive,
            gone_boots=before[node].gone - alive,
            exited_boots=before[node].exited - alive,
            presence_lost_boots=before[node].presence_lost - alive,
            asked=question if node in asking else frozenset(),
        )
    return views
