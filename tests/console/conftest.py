"""Browser fixtures: Debian's chromium driven headless by Playwright (`make test` installs chromium; no
browser is downloaded), a page that fails its test on any JavaScript error, and the directory that
screenshots go to (`$CONSOLE_TEST_OUTPUT/console`, default `test-output/console`)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]


@pytest.fixture(scope="session")
def chromium() -> str:
    found = os.environ.get("TETHER_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("chromium is not installed: `make browser` (apt-get install chromium) sets it up")
    return found


@pytest.fixture(scope="module")
def browser(chromium: str) -> Iterator[object]:
    # Module-scoped: Playwright's sync API holds an event loop running on the main thread while it is
    # open, and every asyncio test after it (pytest-asyncio, asyncio.run) would fail on it.
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        yield launched
        launched.close()


@pytest.fixture
def page(browser: object) -> Iterator[object]:
    """A fresh page at 1280x900; a JavaScript error or a failed script load fails the test."""
    from playwright.sync_api import Browser

    assert isinstance(browser, Browser)
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    opened = context.new_page()
    errors: list[str] = []
    opened.on("pageerror", lambda error: errors.append(f"page error: {error}"))
    opened.on(
        "console",
        lambda message: errors.append(f"console: {message.text}") if message.type == "error" else None,
    )
    yield opened
    context.close()
    expected = [e for e in errors if "status of 4" not in e]  # a 4xx the test provoked is logged by chromium
    assert not expected, expected


@pytest.fixture(scope="session")
def shots() -> Path:
    """Where screenshots of the console's pages go."""
    folder = Path(os.environ.get("CONSOLE_TEST_OUTPUT", "test-output")) / "console"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def load_ms(page: object) -> float:
    """The page's own load time as the browser measured it: navigation start to the load event's end."""
    from playwright.sync_api import Page

    assert isinstance(page, Page)
    return float(
        page.evaluate(
            "() => { const [n] = performance.getEntriesByType('navigation');"
            " return n.loadEventEnd - n.startTime; }"
        )
    )


def record_load_times(shots: Path, name: str, times: list[float]) -> None:
    """The browser-measured loads of one page, with the machine's load average, as JSON beside the
    screenshots (`<name>-load.json`), so the figures the README quotes come from a file a run wrote."""
    import json
    import statistics

    load = os.getloadavg()
    found = {"page": name, "load_ms": times, "median_ms": statistics.median(times), "loadavg": load}
    (shots / f"{name}-load.json").write_text(json.dumps(found, indent=2) + "\n")
