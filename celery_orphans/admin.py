"""The audit log in the admin, readable by whoever may view it and changeable by no one, and the
in-flight view: every running task with the sweep's verdict, and the actions an operator may take."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.db.models import Exists, OuterRef, QuerySet
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import NoReverseMatch, URLPattern, path, reverse
from django.utils.formats import date_format
from django.utils.html import format_html, format_html_join
from django.utils.http import urlencode
from django.utils.safestring import mark_safe
from django.utils.timezone import localtime
from django_celery_results.models import TaskResult

from celery_orphans import operations
from celery_orphans.conf import settings
from celery_orphans.models import OrphanEvent, Trigger
from celery_orphans.verdicts import meaning

ACTIONS = {"recover": "Recover now", "mark_terminal": "Mark terminal"}

if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[OrphanEvent]
else:
    _ModelAdmin = admin.ModelAdmin


@admin.register(OrphanEvent)
class OrphanEventAdmin(_ModelAdmin):
    """A read-only view of what the reconcile did; the record must stay what happened."""

    # Narrow enough to fit 1,400 pixels beside Django's navigation sidebar and the filters: the detail
    # (which names the attempt) and the checkpoint ride along as the reason's tooltip, the evidence's
    # meaning as its own, the user with the trigger; ids and names wrap anywhere, reasons and evidence
    # after an underscore.
    list_display = (
        "created",
        "action",
        "task_id_link",
        "task_name",
        "worker",
        "reason_with_detail",
        "evidence_explained",
        "trigger_and_user",
    )
    # Rows are not linked: the change view is refused, so a link would only lead to a 403.
    list_display_links = None
    list_filter = ("action", "reason", "trigger", "task_name", "worker", "created_at")
    search_fields = ("task_id",)
    change_list_template = "celery_orphans/admin/orphanevent_change_list.html"
    # Offered only to users with the permission to lift a recovery cap (the checkbox column with it).
    actions = ("lift_recovery_cap",)

    @admin.action(
        description="Lift the recovery cap of the selected tasks (the next sweep recovers each once more)",
        permissions=("lift_cap",),
    )
    def lift_recovery_cap(self, request: HttpRequest, queryset: QuerySet[OrphanEvent]) -> None:
        """Lift the cap of the tasks of the chosen events (their terminal mark at the cap, usually)."""
        task_ids = sorted({task_id for task_id in queryset.values_list("task_id", flat=True) if task_id})
        if not task_ids:
            messages.warning(request, "The selected events name no task; nothing was done.")
            return
        if not _within_rate(request):
            return
        try:
            lifted = operations.lift_caps(task_ids, trigger=Trigger.ADMIN, user=request.user.get_username())
        except operations.Refused as exc:
            messages.error(request, f"Lift the recovery cap: nothing was done: {exc}")
            return
        for result in lifted:
            messages.add_message(
                request, messages.SUCCESS if result.lifted else messages.WARNING, result.message
            )

    def has_lift_cap_permission(self, request: HttpRequest) -> bool:
        return bool(request.user.has_perm(operations.LIFT_PERMISSION))

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
            if _within_rate(request):
                _act(request)
            return HttpResponseRedirect(request.get_full_path())
        ask = request.GET.get("ask") == "1" and _within_rate(request)
        try:
            judged, error = operations.in_flight(Trigger.ADMIN, page=_page(request), ask_workers=ask), None
        except operations.Refused as exc:
            judged, error = None, f"Could not judge the running tasks: {exc}"
        context = {
            **self.admin_site.each_context(request),
            "orphans_notices": _notices(),
            "title": "In-flight tasks",
            "opts": self.model._meta,
            "judged": judged,
            "rows": judged.rows if judged else [],
            "counts": judged.counts if judged else [],
            "age": f"{max(0.0, time.time() - judged.judged_at):.0f}" if judged else "",
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
        return format_html('<span title="{}">{}</span>', detail, _breakable(obj.reason))

    @admin.display(description="evidence", ordering="evidence")
    def evidence_explained(self, obj: OrphanEvent) -> str:
        return format_html('<span title="{}">{}</span>', meaning(obj.evidence), _breakable(obj.evidence))

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        return super().changelist_view(request, {**(extra_context or {}), "orphans_notices": _notices()})

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


def _breakable(word: str) -> str:
    """``word`` free to wrap after each underscore (``worker_answered_without_task``), escaped."""
    return format_html_join(mark_safe("_<wbr>"), "{}", ((part,) for part in word.split("_")))


def _notices() -> list[str]:
    """What the admin says above its lists when the sweeps do not act as usual."""
    found = []
    if not settings.ENABLED:
        found.append(
            "celery-orphans is switched off (CELERY_ORPHANS_ENABLED): no sweep recovers or closes anything, "
            "and the actions are refused; workers keep their leases and the ledger."
        )
    if settings.SHADOW_MODE:
        found.append(
            "Shadow mode (CELERY_ORPHANS_SHADOW_MODE): sweeps only record what they would do "
            "(would recover, would mark terminal) and change nothing."
        )
    return found


def _page(request: HttpRequest) -> int:
    try:
        return max(1, int(request.GET.get("p", "1")))
    except ValueError:
        return 1


def _within_rate(request: HttpRequest) -> bool:
    """Count a costly request of the user (an action, a broadcast to the workers); say so when over."""
    try:
        wait = operations.wait_for_rate(request.user, Trigger.ADMIN)
    except operations.Refused:
        return True  # not counted: the request itself meets the same fault and says so
    if wait:
        limit = operations.RATE_LIMIT
        messages.error(
            request,
            f"Nothing was done: at most {limit.hits} actions or worker queries in {limit.seconds} s; "
            f"try again in {wait} s.",
        )
    return not wait


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
        answer = operations.act_on(
            task_ids,
            mark_terminal=action == "mark_terminal",
            trigger=Trigger.ADMIN,
            user=request.user.get_username(),
        )
    except operations.Refused as exc:
        messages.error(request, f"{ACTIONS[action]}: nothing was done: {exc}")
        return
    for result in answer.results:
        level = messages.ERROR if result.failed else messages.WARNING if result.refused else messages.SUCCESS
        messages.add_message(request, level, result.message)
