"""The in-flight admin page as a person sees it: a live server, real workers, and headless Chromium.

Chromium cannot fill in the admin's login form without something driving it, so this module is also
the test's urlconf (``ROOT_URLCONF`` is switched to it): the project's URLs plus one test-only view that
logs the browser in as the superuser and redirects it to the in-flight page. The page itself is the
real admin view, reached with the real session cookie that login set.

The screenshot is kept in ``tests/artifacts/`` for a person to look at.
"""

from __future__ import annotations

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
from django_celery_results.models import TaskResult

from testproject import urls as project_urls
from tests import factories
from tests.helpers import wait_for

ARTIFACTS = Path(__file__).parent / "artifacts"
USERNAME = "browser-admin"
WINDOW = (1400, 900)


def _log_in_as_superuser(request: HttpRequest) -> HttpResponse:
    user = get_user_model().objects.get(username=USERNAME)
    login(request, user, backend="django.contrib.auth.backends.ModelBackend")
    return HttpResponseRedirect(reverse("admin:celery_orphans_inflight"))


urlpatterns = [path("test-only/log-in/", _log_in_as_superuser), *project_urls.urlpatterns]


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
