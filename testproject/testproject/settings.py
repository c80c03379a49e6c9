"""TEST PROJECT: DO NOT COPY THESE SETTINGS. They serve celery-orphans' own tests, demo and benchmarks, on
one machine, with services started for them: a key everyone can read, no HTTPS. A production project
follows the checklist in docs/deployment.md#checklist, which `manage.py check --deploy` passes.

Its services come from the environment, with no default: ``bash tests/run``, ``bash testproject/demo.sh``
and the benchmarks start a Redis server and name a database of their own and set ``REDIS_URL`` and
``DATABASE_URL``, so nothing run from here can reach a service it was not given.
"""

import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

from django.core.exceptions import ImproperlyConfigured

from celery_orphans import recommended_celery_settings


def _required(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise ImproperlyConfigured(
            f"the test project needs {name} in the environment: run it through bash tests/run, "
            "bash testproject/demo.sh or a benchmark, which start services of their own and set it"
        )
    return value


BASE_DIR = Path(__file__).resolve().parent.parent
# "django-insecure-": Django's own mark of a key that must never serve a real site (check --deploy says so).
SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY") or "django-insecure-celery-orphans-test-project-only"
DEBUG = os.environ.get("DJANGO_DEBUG") == "1"  # DJANGO_DEBUG=1 for a local runserver, never more
ALLOWED_HOSTS = ["localhost", "127.0.0.1", "[::1]", "testserver"]
USE_TZ = True
TIME_ZONE = "UTC"
ROOT_URLCONF = "testproject.urls"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "django_celery_results",
    "django_celery_beat",
    "celery_orphans",
    "demoapp",
]
if os.environ.get("TESTPROJECT_PLAIN") == "1":
    # Plain Celery, for the differential suite (tests/test_no_harm.py): the same settings, no extension.
    INSTALLED_APPS.remove("celery_orphans")
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
STATIC_URL = "/static/"


def _database(url: str) -> dict[str, object]:
    parts = urlsplit(url)
    if parts.scheme == "sqlite":
        return {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": unquote(parts.path[1:]) or ":memory:",
            "OPTIONS": {"timeout": 30, "transaction_mode": "IMMEDIATE"},
        }
    engine = {"postgres": "postgresql", "postgresql": "postgresql", "mysql": "mysql", "mariadb": "mysql"}
    if parts.scheme in engine:
        # mysql://root@localhost/name reaches a local server through its socket (mysqlclient's rule).
        return {
            "ENGINE": f"django.db.backends.{engine[parts.scheme]}",
            "NAME": unquote(parts.path[1:]),
            "USER": unquote(parts.username or ""),
            "PASSWORD": unquote(parts.password or ""),
            "HOST": parts.hostname or "",
            "PORT": str(parts.port or ""),
            "OPTIONS": {"charset": "utf8mb4"} if engine[parts.scheme] == "mysql" else {},
        }
    raise ValueError(f"DATABASE_URL scheme {parts.scheme!r} is not supported by the test project")


DATABASES = {"default": _database(_required("DATABASE_URL"))}

REDIS_URL = _required("REDIS_URL")

CELERY_BROKER_URL = os.environ.get("CELERY_BROKER_URL", REDIS_URL)
CELERY_RESULT_BACKEND = "django-db"
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
for _name, _value in recommended_celery_settings(
    visibility_timeout=int(os.environ.get("TESTPROJECT_VISIBILITY_TIMEOUT", "3600")),
    soft_shutdown_timeout=float(os.environ.get("TESTPROJECT_SOFT_SHUTDOWN_TIMEOUT", "10")),
).items():
    globals()[f"CELERY_{_name.upper()}"] = _value

CELERY_ORPHANS_ENABLED = os.environ.get("CELERY_ORPHANS_ENABLED", "true")
# The ledger: on REDIS_URL, unless the environment names one of its own (the settings read it then).
if "CELERY_ORPHANS_REDIS_URL" not in os.environ:
    CELERY_ORPHANS_REDIS_URL = REDIS_URL

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    "loggers": {"celery_orphans": {"handlers": ["console"], "level": "INFO"}},
}
