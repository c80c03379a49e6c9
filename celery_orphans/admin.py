"""The audit log in the admin, readable by whoever may view it and changeable by no one, and the
in-flight view: every running task with the sweep's verdict, and the actions an operator may take."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Exists, OuterRef, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, URLPattern, path, reverse
from django.utils.formats import date_format
from django.utils.html import format_html
from django.utils.http import urlencode
from django.utils.timezone import localtime
from django_celery_results.models import TaskResult

from celery_orphans import operations
from celery_orphans.models import OrphanEvent, Trigger

# The in-flight page lists this many tasks (oldest first); the counts above it cover every one.
IN_FLIGHT_SHOWN = 500
ACTIONS = {"recover": "Recover now", "mark_terminal": "Mark terminal"}
_LEVELS = {"done": messages.SUCCESS, "refused": messages.WARNING, "failed": messages.ERROR}

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[OrphanEvent]
else:
    _ModelAdmin = admin.ModelAdmin


@admin.register(OrphanEvent)
class OrphanEventAdmin(_ModelAdmin):
    """A read-only view of what the reconcile did; the record must stay what happened."""

    # Narrow enough that reason and evidence show without scrolling at 1,400 pixels: the detail (which
    # names the attempt) and the checkpoint ride along as the reason's tooltip, the user with the trigger.
    list_display = (
        "created",
        "action",
        "task_id_link",
        "task_name",
        "worker",
        "reason_with_detail",
        "evidence",
        "trigger_and_user",
    )
    # Rows are not linked: the change view is refused, so a link would only lead to a 403.
    list_display_links = None
    list_filter = ("action", "reason", "trigger", "task_name", "worker", "created_at")
    search_fields = ("task_id",)
    change_list_template = "celery_orphans/admin/orphanevent_change_list.html"

    def get_urls(self) -> list[URLPattern]:
        # Before the model's own patterns, whose "<path:object_id>/" would take "in-flight/".
        in_flight = path(
            "in-flight/", self.admin_site.admin_view(self.in_flight_view), name="celery_orphans_inflight"
        )
        return [in_flight, *super().get_urls()]

    def in_flight_view(self, request: HttpRequest) -> HttpResponse:
        """Every running task with the verdict of one dry-run sweep; the actions need the permission."""
        can_act = request.user.has_perm(operations.PERMISSION)
        if not (can_act or self.has_view_permission(request)):
            raise PermissionDenied
        if request.method == "POST":
            if not can_act:
                raise PermissionDenied
            _act(request)
            return HttpResponseRedirect(request.get_full_path())
        try:
            rows, error = operations.in_flight(Trigger.ADMIN), None
        except operations.SWEEP_ERRORS as exc:
            rows, error = [], f"Could not judge the running tasks: {exc}"
        shown = rows[:IN_FLIGHT_SHOWN]
        context = {
            **self.admin_site.each_context(request),
            "title": "In-flight tasks",
            "opts": self.model._meta,
            "rows": shown,
            "hidden": len(rows) - len(shown),
            "counts": [
                (verdict.value.replace("_", " "), count)
                for verdict, count in Counter(r.verdict for r in rows).most_common()
            ],
            "error": error,
            "can_act": can_act,
            "actions": ACTIONS,
        }
        return TemplateResponse(request, "celery_orphans/admin/in_flight.html", context)

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

    @admin.display(description="created at", ordering="created_at")
    def created(self, obj: OrphanEvent) -> str:
        # Compact, and free to wrap (Django keeps a date column on one line).
        return date_format(localtime(obj.created_at), "Y-m-d H:i:s") if obj.created_at else ""

    @admin.display(description="reason", ordering="reason")
    def reason_with_detail(self, obj: OrphanEvent) -> str:
        # There is no detail page (see has_view_permission), so the detail rides along as a tooltip.
        detail = obj.detail
        if obj.checkpoint_saved_at is not None:
            saved = f"{obj.checkpoint_saved_at:%Y-%m-%d %H:%M:%S}"
            detail += f" (last checkpoint: {obj.checkpoint_bytes} bytes, saved {saved})"
        return format_html('<span title="{}">{}</span>', detail, obj.reason) if detail else obj.reason

    @admin.display(description="trigger", ordering="trigger")
    def trigger_and_user(self, obj: OrphanEvent) -> str:
        trigger = obj.get_trigger_display()
        return f"{trigger} ({obj.triggered_by})" if obj.triggered_by else trigger

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


def _act(request: HttpRequest) -> None:
    """Carry out the chosen action on the selected tasks and say what became of each."""
    action = request.POST.get("action", "")
    if action not in ACTIONS:
        messages.error(request, "Choose an action.")
        return
    selected = request.POST.getlist("task_id")
    if not selected:
        messages.warning(request, "Select the tasks to act on; nothing was done.")
        return
    try:
        task_ids = operations.clean_task_ids(selected)
    except ValueError as exc:
        messages.error(request, f"{exc}; nothing was done.")
        return
    try:
        results = operations.act_on(
            task_ids,
            mark_terminal=action == "mark_terminal",
            trigger=Trigger.ADMIN,
            user=request.user.get_username(),
        )
    except operations.SWEEP_ERRORS as exc:
        messages.error(request, f"{ACTIONS[action]}: nothing was done: {exc}")
        return
    for result in results:
        messages.add_message(request, _LEVELS[result.level], result.message)
