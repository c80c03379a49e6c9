"""The audit log in the admin: readable by whoever may view it, changeable by no one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.contrib import admin
from django.db.models import Exists, OuterRef, QuerySet
from django.http import HttpRequest
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html
from django.utils.http import urlencode
from django_celery_results.models import TaskResult

from celery_orphans.models import OrphanEvent

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[OrphanEvent]
else:
    _ModelAdmin = admin.ModelAdmin


@admin.register(OrphanEvent)
class OrphanEventAdmin(_ModelAdmin):
    """A read-only view of what the reconcile did; the record must stay what happened."""

    list_display = (
        "created_at",
        "action",
        "task_id_link",
        "task_name",
        "worker",
        "reason_with_detail",
        "evidence",
        "attempt",
        "trigger",
        "triggered_by",
    )
    # Rows are not linked: the change view is refused, so a link would only lead to a 403.
    list_display_links = None
    list_filter = ("action", "reason", "trigger", "task_name", "worker", "created_at")
    search_fields = ("task_id",)

    def get_queryset(self, request: HttpRequest) -> QuerySet[OrphanEvent]:
        # One subquery for the whole page decides which task ids get a link, instead of a query per row.
        return (
            super()
            .get_queryset(request)
            .annotate(_has_result=Exists(TaskResult.objects.filter(task_id=OuterRef("task_id"))))
        )

    @admin.display(description="task id", ordering="task_id")
    def task_id_link(self, obj: OrphanEvent) -> str:
        if not getattr(obj, "_has_result", False):
            return obj.task_id
        try:
            changelist = reverse("admin:django_celery_results_taskresult_changelist")
        except NoReverseMatch:  # the project does not show task results in its admin
            return obj.task_id
        return format_html(
            '<a href="{}?{}">{}</a>', changelist, urlencode({"task_id": obj.task_id}), obj.task_id
        )

    @admin.display(description="reason", ordering="reason")
    def reason_with_detail(self, obj: OrphanEvent) -> str:
        # There is no detail page (see has_view_permission), so the detail rides along as a tooltip.
        return format_html('<span title="{}">{}</span>', obj.detail, obj.reason) if obj.detail else obj.reason

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: OrphanEvent | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: OrphanEvent | None = None) -> bool:
        return False

    def has_view_permission(self, request: HttpRequest, obj: OrphanEvent | None = None) -> bool:
        # The list shows every field (the detail as a tooltip); a per-object page would be a change form
        # with nothing to change, so it is refused like the others.
        return obj is None and super().has_view_permission(request)
