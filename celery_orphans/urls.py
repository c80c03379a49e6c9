"""The operators' JSON endpoints: ``path("orphans/", include("celery_orphans.urls"))``."""

from __future__ import annotations

from django.urls import path

from celery_orphans import views

app_name = "celery_orphans"
urlpatterns = [
    path("status/", views.status, name="status"),
    path("sweep/", views.sweep_now, name="sweep"),
]
