# Shared set-up for tests/run and testproject/demo.sh; source it, then call `setup_env`.
# Run as `bash tests/setup-env.sh` it only makes sure the services answer (tox does that).
#
# It makes sure that:
#   - a virtualenv exists at $VENV (default: .venv in the repository root), made with $PYTHON (default:
#     python3), holding celery-orphans installed in editable mode with the extras named in $EXTRAS
#     (default: test; CI uses EXTRAS=test,docs,prometheus) and the requirements in $VERSIONS (default:
#     none, so the newest that pyproject.toml allows; e.g. VERSIONS="Django>=6.0,<6.1 celery>=5.7,<5.8"),
#     the test and docs tools at the versions tests/constraints.txt pins (FRESH_TOOLS=1: the newest).
#     It is created afresh when missing or broken, and reinstalled only when pyproject.toml is newer than
#     the stamp file in it or $EXTRAS or $VERSIONS differ from what it records;
#   - (not for the demo, which needs only redis-server) PostgreSQL (127.0.0.1:5432) and RabbitMQ (127.0.0.1:5672) answer, starting whichever does not and
#     waiting (bounded) until it does, and redis-server is installed. The tests and the demo run a Redis
#     server of their own and use a database and a RabbitMQ vhost of their own on those servers
#     (tests/services.py); a server named by TEST_DATABASE_URL or TEST_AMQP_URL is not checked here;
#   - Debian's faketime package (libfaketime) is installed, with apt-get when missing and this runs as root:
#     the fault tests step a worker's clock with it (tests/faults.py);
#   - with TEST_DATABASE_URL=mysql://... (MySQL or MariaDB), mysqlclient is in the virtualenv (built
#     against libmariadb-dev, which is installed with apt-get when missing and this runs as root), and a
#     local MariaDB answers when the URL names localhost.
# Afterwards $VENV/bin is first on PATH. Every step prints one short line.

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
EXTRAS="${EXTRAS:-test}"
PYTHON="${PYTHON:-python3}"
VERSIONS="${VERSIONS:-}"
SERVICE_WAIT_SECONDS="${SERVICE_WAIT_SECONDS:-60}"
# The test and docs tools' versions (see the file); FRESH_TOOLS=1 takes the newest instead.
CONSTRAINTS="$ROOT/tests/constraints.txt"

say() { printf '%s\n' "$*" >&2; }
die() { say "error: $*"; exit 1; }

# Print pip's output without its "Location ... is ignored" warnings about absent local indexes.
quiet_pip_output() {
    grep -v -E 'Location .* is ignored' "$1" >&2 || true
    rm -f "$1"
}

setup_venv() {
    local stamp="$VENV/.celery-orphans-installed"
    if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import pip' >/dev/null 2>&1 \
        && [ "$("$VENV/bin/python" -V 2>&1)" = "$("$PYTHON" -V 2>&1)" ]; then
        # The stamp records the extras and versions installed; an empty one means the default extras.
        local installed wanted="$EXTRAS${VERSIONS:+ $VERSIONS}${FRESH_TOOLS:+ fresh tools}"
        installed="$(cat "$stamp" 2>/dev/null)"
        if [ -f "$stamp" ] && [ ! "$ROOT/pyproject.toml" -nt "$stamp" ] && [ ! "$CONSTRAINTS" -nt "$stamp" ] \
            && [ "${installed:-test}" = "$wanted" ]; then
            say "venv: reusing $VENV"
            return 0
        fi
    else
        command -v "$PYTHON" >/dev/null 2>&1 || die "$PYTHON is not on PATH (PYTHON names the interpreter)"
        say "venv: creating $VENV with $("$PYTHON" -c 'import sys; print("Python", sys.version.split()[0])')"
        rm -rf "$VENV"
        "$PYTHON" -m venv "$VENV" || die "$PYTHON -m venv $VENV failed"
    fi
    say "venv: installing celery-orphans[$EXTRAS] (editable)${VERSIONS:+ with $VERSIONS}"
    local log
    log="$(mktemp)"
    local -a constrain=()
    [ "${FRESH_TOOLS:-}" = 1 ] || constrain=(-c "$CONSTRAINTS")
    # shellcheck disable=SC2086 # VERSIONS is a list of requirements
    if ! (cd "$ROOT" && "$VENV/bin/python" -m pip install -q "${constrain[@]}" -e ".[$EXTRAS]" $VERSIONS) \
        >"$log" 2>&1; then
        quiet_pip_output "$log"
        die "pip install -e .[$EXTRAS] $VERSIONS failed"
    fi
    quiet_pip_output "$log"
    printf '%s' "$EXTRAS${VERSIONS:+ $VERSIONS}${FRESH_TOOLS:+ fresh tools}" >"$stamp"
}

# put_pythons_on_path MINOR...: make python3.MINOR answer on PATH from pyenv's newest 3.MINOR.x, where
# PATH has none and pyenv has one (pyenv's shims answer only for the selected version).
put_pythons_on_path() {
    local minor version
    for minor in "$@"; do
        command -v "python3.$minor" >/dev/null 2>&1 && "python3.$minor" -V >/dev/null 2>&1 && continue
        command -v pyenv >/dev/null 2>&1 || continue
        version="$(pyenv versions --bare 2>/dev/null | grep -E "^3\.$minor\.[0-9]+$" | sort -V | tail -1)"
        [ -n "$version" ] && PATH="$(pyenv root)/versions/$version/bin:$PATH"
    done
    export PATH
}

# wait_until SECONDS CHECK...: run CHECK every half second until it succeeds or SECONDS pass.
wait_until() {
    local deadline=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        [ "$SECONDS" -ge "$deadline" ] && return 1
        sleep 0.5
    done
}

tcp_open() { timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2" 2>/dev/null; }

postgresql_up() { pg_isready -q -h 127.0.0.1 -p 5432; }

rabbitmq_up() { tcp_open 127.0.0.1 5672; }

start_postgresql() {
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start
}

start_rabbitmq() { rabbitmq-server -detached; }

mariadb_up() { mariadb-admin ping; }

start_mariadb() { start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd; }

wants_mysql() { case "${TEST_DATABASE_URL:-}" in mysql://* | mariadb://*) return 0 ;; *) return 1 ;; esac; }

# mysqlclient compiles against the MariaDB (or MySQL) client library, which pkg-config must find.
setup_mysqlclient() {
    "$VENV/bin/python" -c 'import MySQLdb' >/dev/null 2>&1 && return 0
    if ! pkg-config --exists libmariadb 2>/dev/null && ! pkg-config --exists mysqlclient 2>/dev/null; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            say "installing libmariadb-dev and pkg-config with apt-get (mysqlclient builds against them)"
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q libmariadb-dev pkg-config >/dev/null 2>&1 \
                || die "apt-get install libmariadb-dev pkg-config failed"
        else
            die "mysqlclient needs the MariaDB client library: apt install libmariadb-dev pkg-config"
        fi
    fi
    say "venv: installing mysqlclient"
    local log
    log="$(mktemp)"
    "$VENV/bin/python" -m pip install -q mysqlclient >"$log" 2>&1 || { quiet_pip_output "$log"; die "pip install mysqlclient failed"; }
    quiet_pip_output "$log"
}

# The fault tests preload libfaketime into a worker to step its clock (tests/faults.py).
setup_faketime() {
    compgen -G "/usr/lib/*/faketime/libfaketimeMT.so.1" >/dev/null || [ -n "${FAKETIME_LIBRARY:-}" ] && return 0
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing faketime with apt-get (the fault tests step a worker's clock with libfaketime)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q faketime >/dev/null 2>&1 \
            || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q faketime >/dev/null 2>&1; } \
            || die "apt-get install faketime failed"
    else
        die "the fault tests need libfaketime: apt install faketime (or set FAKETIME_LIBRARY to its libfaketimeMT.so.1)"
    fi
}

# ensure_service NAME: leave it alone if it answers, else start it and wait for it.
ensure_service() {
    local name="$1" started=$SECONDS
    if "${name}_up"; then
        say "$name: up"
        return 0
    fi
    say "starting $name"
    "start_${name}" >/dev/null 2>&1 || say "$name: start command failed; waiting in case it is coming up anyway"
    wait_until "$SERVICE_WAIT_SECONDS" "${name}_up" \
        || die "$name does not answer after ${SERVICE_WAIT_SECONDS}s"
    say "$name: up after $((SECONDS - started))s"
}

need_redis_server() {
    command -v redis-server >/dev/null 2>&1 || die "redis-server is not installed (apt install redis-server)"
}

ensure_services() {
    need_redis_server
    [ -n "${TEST_DATABASE_URL:-}" ] || ensure_service postgresql
    case "${TEST_DATABASE_URL:-}" in
        mysql://*@localhost* | mariadb://*@localhost*) ensure_service mariadb ;;
    esac
    [ -n "${TEST_AMQP_URL:-}" ] || ensure_service rabbitmq
}

# setup_env [demo]: the demo needs only the virtualenv and redis-server (its own Redis, a SQLite file).
setup_env() {
    setup_venv
    if [ "${1:-}" = demo ]; then
        need_redis_server
    else
        setup_faketime
        if wants_mysql; then setup_mysqlclient; fi
        ensure_services
    fi
    export VIRTUAL_ENV="$VENV"
    export PATH="$VENV/bin:$PATH"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -uo pipefail
    ensure_services
fi
