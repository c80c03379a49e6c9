"""What runs in a worker: the Request hook of recoverable tasks in the main process, the outbox of its
ledger writes, the heartbeat that keeps its lease, and what it does itself when a pool process dies or the
broker delivers a lost execution's message again (``takeover``)."""
