"""Evidence that a worker is alive: one ``query_task`` broadcast, plus the leases in Redis."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor

import redis
from celery import Celery

from celery_orphans import leases
from celery_orphans.reconcile import WorkerView

logger = logging.getLogger(__name__)


def ask_workers(
    app: Celery, nodes: Collection[str], task_ids: Collection[str], timeout: float
) -> dict[str, frozenset[str]]:
    """Which of ``task_ids`` each node holds, for the nodes that answered; asked about no id, a node
    still answers, which says it is alive.

    One broadcast to an explicit destination list: it returns as soon as every named node has replied,
    so live workers cost one round trip and only silent ones cost the timeout.
    """
    if not nodes:
        return {}
    destination = sorted(nodes)
    try:
        replies = app.control.inspect(destination=destination, timeout=timeout).query_task(*task_ids)
    except app.connection_for_write().connection_errors as exc:
        # A pooled broker connection that the broker dropped: once more, on a connection of our own
        # (emptying the shared pool instead would leave later acquires waiting for ever).
        logger.info("celery-orphans: broker connection lost while asking workers (%s); retrying", exc)
        with app.connection_for_write() as conn:
            inspect = app.control.inspect(destination=destination, timeout=timeout, connection=conn)
            replies = inspect.query_task(*task_ids)
    return {
        node: frozenset(held) if isinstance(held, dict) else frozenset()
        for node, held in (replies or {}).items()
    }


def observe(
    app: Celery,
    nodes: Collection[str],
    task_ids: Collection[str],
    timeout: float,
    conn: redis.Redis[bytes] | None = None,
    meanwhile: Callable[[], object] | None = None,
    own: Mapping[str, Collection[str]] | None = None,
) -> dict[str, WorkerView]:
    """A ``WorkerView`` for every node: its answer to the broadcast and its fresh leases.

    Every node is asked about ``task_ids``, and about the ``own`` ids of each node whose lease is fresh.
    Every worker reads the whole broadcast, whoever it names, so the question leaves out what only a
    node with no live lease, most likely dead, was running; should such a node answer after all, its
    reply speaks only for the ids it was asked about (``WorkerView.asked``), and the caller asks again.

    Leases are read before the broadcast and again after it for the nodes that stayed silent, and a
    lease seen fresh either time counts: a heartbeat held up by a Redis pause lands the moment Redis
    answers again, inside the broadcast's wait, so a live worker is not judged by that gap.

    ``meanwhile`` runs in this thread while the broadcast waits for its replies (on a thread of its own,
    which only waits on the broker's socket).
    """
    before = leases.fresh_boots(nodes, conn, prune=False)
    question = set(task_ids)
    for node, ids in (own or {}).items():
        if before.get(node):
            question.update(ids)
    if meanwhile is None:
        held = ask_workers(app, nodes, question, timeout)
    else:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="celery-orphans-ask") as pool:
            asking = pool.submit(ask_workers, app, nodes, question, timeout)
            meanwhile()
            held = asking.result()
    silent = [node for node in nodes if node not in held]
    after = leases.fresh_boots(silent, conn, prune=False) if silent else {}
    fresh = {node: before.get(node, frozenset()) | after.get(node, frozenset()) for node in nodes}
    asked = frozenset(question)
    return {
        node: WorkerView(
            replied=node in held,
            held=held.get(node, frozenset()),
            fresh_boots=fresh.get(node, frozenset()),
            asked=asked,
        )
        for node in nodes
    }
