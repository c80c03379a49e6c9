"""Django signals sent after a sweep or a worker acts on an orphan, once its change is committed.

Every signal is sent with ``sender=OrphanEvent`` and these keyword arguments:

- ``task_id``, ``task_name``, ``worker``: the task and the node name that lost it;
- ``evidence``: what proved it orphaned (``lease_lapsed``, ``found_at_boot``, ...);
- ``reason``: the decision's reason (``recoverable``, ``not_recoverable``, ``limit_reached``, ...);
- ``attempt``: the recovery attempt sent (``orphan_recovered``) or the count reached;
- ``trigger``: what ran the sweep (``beat``, ``command``, ``worker_boot``, ``worker``, ``admin``, ``api``).

``orphan_detected`` comes first for every orphan acted on, then one of the other two. A receiver that
raises is logged and does not stop the sweep or the other receivers.
"""

from __future__ import annotations

from django.dispatch import Signal

orphan_detected = Signal()
orphan_recovered = Signal()
orphan_marked_terminal = Signal()
