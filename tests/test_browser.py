"""The in-flight admin page as a person sees it: a live server, real workers, and headless Chromium.

Chromium cannot fill in the admin's login form without something driving it, so this module is also
the test's urlconf (``ROOT_URLCONF`` is switched to it): the project's URLs plus one test-only view that
logs the browser in as the superuser and redirects it to the in-flight page. The page itself is the
real admin view, reached with the real session cookie that login set.

The screenshot is kept in ``tests/artifacts/`` for a person to look at.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from django.contrib.auth import get_user_model, login
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.urls import path, reverse
from django.utils.http import urlencode
from django_celery_results.models import TaskResult

from testproject import urls as project_urls
from tests import factories
from tests.helpers import wait_for
from tests.test_admin import event

ARTIFACTS = Path(__file__).parent / "artifacts"
USERNAME = "browser-admin"
WINDOW = (1400, 900)


def _log_in_as_superuser(request: HttpRequest) -> HttpResponse:
    user = get_user_model().objects.get(username=USERNAME)
    login(request, user, backend="django.contrib.auth.backends.ModelBackend")
    return HttpResponseRedirect(request.GET.get("next") or reverse("admin:celery_orphans_inflight"))


# Loads an admin page in a frame the size of the window and writes what its layout measures into this
# page, which --dump-dom prints: whether the table scrolls sideways, and the gaps between its headers.
MEASURE = """<!doctype html><html><body style="margin:0">
<iframe id="page" src="%s" style="border:0;width:100vw;height:100vh"></iframe>
<script>
document.getElementById("page").addEventListener("load", function () {
  var d = this.contentDocument, box = d.querySelector("#changelist .results") || d.querySelector(".results");
  var heads = Array.from(d.querySelectorAll("#result_list thead th")).filter(function (th) {
    return th.textContent.trim() && !th.classList.contains("action-checkbox-column");
  }).map(function (th) {
    var r = document.createRange(); r.selectNodeContents(th.querySelector("span") || th);
    var b = r.getBoundingClientRect(); return [b.left, b.right];
  });
  var gaps = heads.slice(1).map(function (h, i) { return Math.round(h[0] - heads[i][1]); });
  var out = document.createElement("pre"); out.id = "measured";
  var widths = Array.from(d.querySelectorAll("#result_list thead th")).map(function (th) {
    return [th.textContent.trim(), Math.round(th.getBoundingClientRect().width)];
  });
  var sidebar = d.querySelector("#nav-sidebar"), last = d.querySelector("#result_list thead th:last-child");
  out.textContent = JSON.stringify({
    scrolls: box.scrollWidth > box.clientWidth, gaps: gaps, widths: widths, room: box.clientWidth,
    sidebar: sidebar ? Math.round(sidebar.getBoundingClientRect().width) : 0,
    last_right: last ? Math.round(last.getBoundingClientRect().right) : 0,
    box_right: Math.round(box.getBoundingClientRect().right)
  });
  document.body.appendChild(out);
});
</script></body></html>"""


def _measure(request: HttpRequest) -> HttpResponse:
    return HttpResponse(MEASURE % request.GET["page"])


urlpatterns = [
    path("test-only/log-in/", _log_in_as_superuser),
    path("test-only/measure/", _measure),
    *project_urls.urlpatterns,
]


def chromium() -> str:
    """Debian's Chromium, installed here if it is missing and this user may; skip only if it cannot be."""
    found = shutil.which("chromium")
    if found:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("Chromium is not installed and apt-get cannot install it here (not root, or no apt-get)")
    installed = _apt("install", "-y", "-q", "chromium")
    if not shutil.which("chromium"):  # the package lists may be missing or stale: refresh them once
        _apt("update", "-q")
        installed = _apt("install", "-y", "-q", "chromium")
    found = shutil.which("chromium")
    if not found:
        pytest.skip(f"Chromium could not be installed with apt-get: {installed.stderr.strip()[-500:]}")
    return found


def _apt(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    return subprocess.run(
        ["apt-get", *args], env=env, capture_output=True, text=True, timeout=900, check=False
    )


def browse(binary: str, profile: Path, url: str, *mode: str) -> str:
    command = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--no-first-run",
        f"--user-data-dir={profile}",
        f"--window-size={WINDOW[0]},{WINDOW[1]}",
        *mode,
        url,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def png_size(image: Path) -> tuple[int, int]:
    header = image.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", f"{image} is not a PNG"
    return struct.unpack(">II", header[16:24])  # type: ignore[return-value]


def verdict_of(dom: str, task_id: str) -> str:
    row = next(r for r in re.findall(r"<tr>.*?</tr>", dom, re.DOTALL) if task_id in r)
    found = re.search(r'<span class="verdict[^"]*"[^>]*>(.*?)</span>', row, re.DOTALL)
    assert found, row
    return found.group(1).strip()


@pytest.mark.worker
def test_in_flight_page_shows_a_live_task_an_orphan_and_a_non_recoverable_orphan(
    workers, live_server, settings, django_user_model, tmp_path
):
    binary = chromium()
    from demoapp.tasks import summarize

    settings.ROOT_URLCONF = __name__
    settings.CELERY_ORPHANS_GRACE_SECONDS = 0  # the live task is judged at once, not left in grace
    django_user_model.objects.create_superuser(USERNAME, password="unused")
    workers.start("busy@test")
    live = summarize.delay([1, 2], seconds=120).id
    wait_for(
        lambda: TaskResult.objects.filter(task_id=live, status="STARTED").exists(), 30, f"{live} to start"
    )
    orphan = factories.orphan()
    not_recoverable = factories.orphan("demoapp.scan", ("db",))
    url = f"{live_server.url}/test-only/log-in/"

    dom = browse(binary, tmp_path / "dom-profile", url, "--dump-dom")
    ARTIFACTS.mkdir(exist_ok=True)
    screenshot = ARTIFACTS / "in_flight.png"
    screenshot.unlink(missing_ok=True)
    browse(binary, tmp_path / "shot-profile", url, f"--screenshot={screenshot}")

    assert "In-flight tasks" in dom
    assert verdict_of(dom, live) == "alive"
    assert verdict_of(dom, orphan) == "orphan (will be recovered)"
    assert verdict_of(dom, not_recoverable) == "not recoverable"
    assert "busy@test" in dom and factories.GHOST in dom
    assert "Recover now" in dom
    assert png_size(screenshot) == WINDOW


def measured(binary: str, profile: Path, server: str, page: str) -> dict[str, object]:
    """Log in, then measure ``page`` as Chromium lays it out in the test's window."""
    measure = f"/test-only/measure/?{urlencode({'page': page})}"
    url = f"{server}/test-only/log-in/?{urlencode({'next': measure})}"
    dom = browse(binary, profile, url, "--dump-dom", "--virtual-time-budget=10000")
    found = re.search(r'<pre id="measured">(.*?)</pre>', dom, re.DOTALL)
    assert found, dom[-2000:]
    return json.loads(found.group(1))


@pytest.mark.django_db(transaction=True)
def test_the_empty_in_flight_page_and_the_audit_list_read_cleanly_at_1400_pixels(
    live_server, settings, django_user_model, tmp_path, redis_client
):
    binary = chromium()
    settings.ROOT_URLCONF = __name__
    settings.X_FRAME_OPTIONS = "SAMEORIGIN"  # the measuring page frames the admin, from the same origin
    django_user_model.objects.create_superuser(USERNAME, password="unused")
    event(
        "0f0e9b2c-53c4-4f0a-9d65-6a1f3c2b9e71",
        task_name="reports.build_quarterly_statement_for_every_region",
        worker="celery@worker-pool-eu-west-1c-7d9f8b6c4-x2x9z",
        trigger="admin",
        triggered_by="operations-on-call",
    )
    # The longest value of each column (a shadow mode row, the longest evidence, reason and trigger).
    event(
        "7a1d2c3b-4e5f-4061-8273-9485a6b7c8d9",
        task_name="billing.tasks.reconcile_every_invoice_of_the_previous_quarter",
        worker="celery@worker-pool-us-east-2b-5f6e7d8c9-a1b2c",
        action="would_mark_terminal",
        reason="already_finished",
        evidence="worker_answered_without_task",
        trigger="watch",
    )

    empty = measured(binary, tmp_path / "empty", live_server.url, reverse("admin:celery_orphans_inflight"))
    audit = measured(
        binary, tmp_path / "audit", live_server.url, reverse("admin:celery_orphans_orphanevent_changelist")
    )

    assert len(empty["gaps"]) == 6 and min(empty["gaps"]) >= 8, empty  # headers apart, not run together
    assert audit["sidebar"] > 0, json.dumps(audit)  # Django's navigation sidebar, open as by default
    assert audit["scrolls"] is False, json.dumps(audit)
    assert audit["last_right"] <= audit["box_right"], json.dumps(audit)  # the trigger column in view
