"""Prometheus metrics, when ``prometheus-client`` is installed (``pip install celery-orphans[prometheus]``).

Metrics go to prometheus-client's default registry, which a project exposes as it already does
(django-prometheus, ``prometheus_client.start_http_server``, multiprocess mode for workers).
"""

from __future__ import annotations

from typing import Any

try:
    import prometheus_client
except ImportError:  # the extra is optional: without it every function here does nothing
    prometheus_client = None  # type: ignore[assignment]

_metrics: dict[str, Any] = {}

# From a worker's death to its task being sent again: seconds, up to a few minutes.
RECOVERY_BUCKETS = (1, 2, 5, 10, 15, 20, 30, 45, 60, 120, 300, 600, float("inf"))


def enabled() -> bool:
    return prometheus_client is not None


def _get() -> dict[str, Any]:
    if prometheus_client is None:
        return {}
    if not _metrics:
        p = prometheus_client
        _metrics.update(
            recovered=p.Counter(
                "celery_orphans_recovered", "Orphaned tasks sent again.", ["task_name", "evidence"]
            ),
            marked_terminal=p.Counter(
                "celery_orphans_marked_terminal", "Orphaned tasks marked terminal.", ["task_name", "reason"]
            ),
            heartbeat_to_recovery=p.Histogram(
                "celery_orphans_heartbeat_to_recovery_seconds",
                "From the last heartbeat of the worker that lost a task to the task being sent again.",
                buckets=RECOVERY_BUCKETS,
            ),
            sweep_duration=p.Histogram("celery_orphans_sweep_duration_seconds", "Duration of a sweep."),
            # Set by every sweep; in multiprocess mode the value of the process that set it last.
            leases=p.Gauge(
                "celery_orphans_leases", "Worker boots holding a live lease.", multiprocess_mode="mostrecent"
            ),
        )
    return _metrics


def recovered(task_name: str, evidence: str, since_last_heartbeat: float | None) -> None:
    m = _get()
    if m:
        m["recovered"].labels(task_name=task_name, evidence=evidence).inc()
        if since_last_heartbeat is not None:
            m["heartbeat_to_recovery"].observe(max(0.0, since_last_heartbeat))


def marked_terminal(task_name: str, reason: str) -> None:
    m = _get()
    if m:
        m["marked_terminal"].labels(task_name=task_name, reason=reason).inc()


def swept(seconds: float, leases: int | None) -> None:
    """A sweep took ``seconds``; ``leases`` worker boots held a live lease (``None``: not counted)."""
    m = _get()
    if m:
        m["sweep_duration"].observe(seconds)
        if leases is not None:
            m["leases"].set(leases)
