from django.conf import settings
from django.contrib import admin
from django.urls import include, path

urlpatterns = [path("admin/", admin.site.urls)]
if "celery_orphans" in settings.INSTALLED_APPS:  # left out for plain Celery (settings.py)
    urlpatterns.append(path("orphans/", include("celery_orphans.urls")))
