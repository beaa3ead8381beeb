"""Headless Chromium for the tests that look at a page as a person would: the server's chat page
and Snakemake's HTML report. Debian's chromium and chromium-driver packages, driven by selenium
(`.ci/run` installs them before the slow tests). Without them a test is skipped, unless
LLM_LIFECYCLE_REQUIRE_BROWSER=1 (set by .ci/run), where a missing browser fails it."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator

import pytest

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def require_browser() -> None:
    """Skip (or, under LLM_LIFECYCLE_REQUIRE_BROWSER=1, fail) when Chromium is not installed."""
    if not (CHROMIUM and DRIVER):
        if os.environ.get("LLM_LIFECYCLE_REQUIRE_BROWSER") == "1":
            pytest.fail("chromium and chromedriver are required (apt-get install chromium chromium-driver)")
        pytest.skip("no chromium/chromedriver (apt-get install chromium chromium-driver)")


@contextlib.contextmanager
def headless_chromium(window_size: str = "1000,700") -> Iterator:
    """A selenium driver of headless Chromium, quit on exit."""
    require_browser()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={window_size}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def screenshot(driver, name: str) -> None:
    """Save the page to $LLM_LIFECYCLE_SCREENSHOT_DIR/<name>.png when that is set (for a person to look at)."""
    folder = os.environ.get("LLM_LIFECYCLE_SCREENSHOT_DIR")
    if folder:
        os.makedirs(folder, exist_ok=True)
        driver.save_screenshot(os.path.join(folder, f"{name}.png"))
