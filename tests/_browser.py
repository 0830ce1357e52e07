"""Headless Chromium driven by Selenium, for the web page's tests (tests/serve). The browser and its
driver come from Debian's packages (chromium, chromium-driver: .ci/run installs them), never from a
download at run time."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome")
DRIVER = ("/usr/bin/chromedriver", "/usr/lib/chromium/chromedriver")


def _first(paths: tuple[str, ...], name: str) -> str | None:
    found = next((p for p in paths if Path(p).is_file()), None)
    return found or shutil.which(name)


@contextmanager
def chromium(downloads: Path) -> Iterator[Any]:
    """A headless Chromium session whose downloads land in `downloads`. Missing browser: the test fails
    under CI (which installs it) and is skipped elsewhere, saying how to install it."""
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = _first(CHROMIUM, "chromium"), _first(DRIVER, "chromedriver")
    if not binary or not driver_path:
        message = "the page's tests need Chromium and its driver: apt-get install chromium chromium-driver"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1000",
                "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """check()'s first truthy value, polled; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.05)
