"""Headless Chromium (Debian's chromium and chromium-driver, driven by Selenium) for checking what
the Prefect UI shows: a page's screenshot, and whether its images really loaded (an <img> whose
naturalWidth is 0 is a broken image, however present its element)."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
# The machine has no network: without these Chromium retries its background connections.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1400,1800"]


def missing() -> str | None:
    """What is missing to run the browser checks, or None."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).is_file():
            return (f"{path} not found: apt-get install chromium chromium-driver (.ci/run does "
                    "this)")
    return None


class Browser:
    def __init__(self):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.profile = tempfile.mkdtemp(prefix="draftsmith-chromium-")
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in (*FLAGS, f"--user-data-dir={self.profile}"):
            options.add_argument(flag)
        self.driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
        self.driver.set_page_load_timeout(120)

    def images(self, url: str, selector: str, timeout_s: float = 120) -> list[dict]:
        """Open `url` and wait until an image matching `selector` (a CSS selector) has loaded or
        failed; returns every matching image's src prefix, natural size and completeness."""
        self.driver.get(url)
        deadline = time.monotonic() + timeout_s
        found: list[dict] = []
        while time.monotonic() < deadline:
            found = self.driver.execute_script(
                "return Array.from(document.querySelectorAll(arguments[0])).map(i => ({"
                "src: i.src.slice(0, 40), complete: i.complete, width: i.naturalWidth, "
                "height: i.naturalHeight, alt: i.alt}))", selector)
            if found and all(i["complete"] for i in found):
                return found
            time.sleep(0.5)
        return found

    def show(self, url: str, text: str, timeout_s: float = 120) -> bool:
        """Open `url` and wait until the page shows `text` (the UI renders after loading);
        True when it did."""
        self.driver.get(url)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            shown = self.driver.execute_script(
                "return document.body ? document.body.innerText : ''")
            if text in shown:
                return True
            time.sleep(0.5)
        return False

    def screenshot(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.driver.save_screenshot(str(path))
        return path

    def close(self) -> None:
        self.driver.quit()
        shutil.rmtree(self.profile, ignore_errors=True)
