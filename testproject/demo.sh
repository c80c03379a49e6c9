#!/usr/bin/env bash
# The demo: a worker is killed mid-task and the task is recovered, step by step with timings.
# Sets up the virtualenv the same way as tests/run, checks redis-server is installed (the demo starts a
# Redis of its own and uses a SQLite file: no PostgreSQL, no RabbitMQ), then runs testproject/demo.py.
set -uo pipefail

source "$(dirname "${BASH_SOURCE[0]}")/../tests/setup-env.sh"
setup_env demo
cd "$ROOT"
say "running the demo"
exec "$VENV/bin/python" testproject/demo.py "$@"
