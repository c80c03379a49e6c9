"""Carrying a decision out: the claim in the ledger, the result row, the broker, the audit log.

Both the sweep and a worker that sees an orphan itself (a lost pool process, a redelivery) act through
this layer, which neither owns: ``executor`` (the steps of recover, mark terminal, forget), ``rows``
(django-celery-results rows), ``broker`` (the exact message sent again, dead deliveries, revokes),
``audit`` (the audit row and the signals) and ``outcome`` (what became of one decision).
"""
