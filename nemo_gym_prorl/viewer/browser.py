"""A headless Chromium driven through WebDriver, for the viewer's tests, screenshots and benchmark: Debian's
`chromium` and its `chromedriver` (scripts/bootstrap.sh installs both), never a browser downloaded at run time."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from selenium.webdriver import Chrome

CHROMIUM = "chromium"
CHROMEDRIVER = "chromedriver"


def chromium_available() -> bool:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return False
    return shutil.which(CHROMIUM) is not None and shutil.which(CHROMEDRIVER) is not None


@contextmanager
def headless_chromium(width: int = 1400, height: int = 1000, implicit_wait_s: float = 20.0) -> Iterator[Chrome]:
    """One browser with a profile of its own (removed after), quit on the way out whatever happened.
    `implicit_wait_s`: how long `find_element` looks for an element not there yet."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, chromedriver = shutil.which(CHROMIUM), shutil.which(CHROMEDRIVER)
    if chromium is None or chromedriver is None:
        raise FileNotFoundError("the viewer's browser needs Debian's chromium and chromium-driver: "
                                "apt-get install chromium chromium-driver")
    with tempfile.TemporaryDirectory(prefix="prorl-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = chromium
        for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--no-first-run", "--disable-extensions", "--disable-background-networking",
                         f"--user-data-dir={profile}", f"--window-size={width},{height}"):
            options.add_argument(argument)
        driver = webdriver.Chrome(options=options, service=Service(executable_path=chromedriver))
        try:
            driver.implicitly_wait(implicit_wait_s)
            yield driver
        finally:
            driver.quit()
