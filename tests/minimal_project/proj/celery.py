import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "proj.settings")

app = Celery("proj")
app.config_from_object("django.conf:settings", namespace="CELERY")
# The project's own tasks live in the project package, outside INSTALLED_APPS.
app.autodiscover_tasks(["proj"])
app.autodiscover_tasks()
