"""A new project as the quick start sets it up, with tasks outside INSTALLED_APPS.

Its services come from the environment: DATABASE_URL (sqlite:///path, postgres://... or mysql://...) and
REDIS_URL.
"""

import os
from urllib.parse import unquote, urlsplit

from celery_orphans import recommended_celery_settings

SECRET_KEY = "minimal-project-not-secret"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django_celery_results",
    "django_celery_beat",
    "celery_orphans",
]

_db = urlsplit(os.environ["DATABASE_URL"])
if _db.scheme == "sqlite":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": unquote(_db.path[1:]),
            "OPTIONS": {"timeout": 30},  # Beat, the worker and its pool share the file
        }
    }
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends." + ("mysql" if _db.scheme == "mysql" else "postgresql"),
            "NAME": unquote(_db.path[1:]),
            "USER": unquote(_db.username or ""),
            "HOST": _db.hostname or "",
            "PORT": str(_db.port or ""),
        }
    }

CELERY_BROKER_URL = os.environ["REDIS_URL"]
CELERY_RESULT_BACKEND = "django-db"
CELERY_IMPORTS = ["proj.imported", *filter(None, os.environ.get("PROJ_MORE_IMPORTS", "").split(","))]
CELERY_INCLUDE = ["proj.included"]
for _name, _value in recommended_celery_settings().items():
    globals()[f"CELERY_{_name.upper()}"] = _value

CELERY_ORPHANS_ENABLED = True
