"""A headless Chromium driven by Selenium, for the status page's browser test and its README screenshot.

Selenium is not a dependency of p2p-diloco: it is imported inside `headless_chromium()`, and a machine without
it, Chromium or chromedriver gets a RuntimeError saying which is missing (the test turns that into a skip).
"""

from __future__ import annotations

import shutil

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def find_chromium() -> tuple[str | None, str | None]:
    """(browser binary, chromedriver) found on PATH, None for each one missing."""
    browser = next((p for p in map(shutil.which, BROWSERS) if p), None)
    return browser, shutil.which("chromedriver")


def headless_chromium(width: int = 1280, height: int = 900):
    """A started headless Chromium WebDriver with a `width` x `height` window; the caller must `quit()` it.

    The browser's console is recorded (`driver.get_log("browser")`) so a test can fail on page errors.
    """
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError as e:
        raise RuntimeError("selenium is not installed (pip install selenium)") from e
    browser, chromedriver = find_chromium()
    if browser is None:
        raise RuntimeError(f"no Chromium browser on PATH (looked for {', '.join(BROWSERS)})")
    if chromedriver is None:
        raise RuntimeError("no chromedriver on PATH (apt-get install chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    # --no-sandbox: containers and CI run as root, where Chromium's sandbox refuses to start;
    # --disable-dev-shm-usage: Docker's 64 MB /dev/shm crashes tabs.
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}", "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        driver = webdriver.Chrome(options=options, service=Service(chromedriver))
    except Exception as e:  # WebDriverException: a version mismatch or a browser that cannot start here
        raise RuntimeError(f"cannot start headless Chromium ({browser} with {chromedriver}): {e}") from e
    # The window size includes the browser's frame: grow it by the difference so the page itself gets
    # width x height (what a screenshot shows).
    driver.set_window_size(width, height)
    inner_w, inner_h = driver.execute_script("return [window.innerWidth, window.innerHeight]")
    if (inner_w, inner_h) != (width, height):
        driver.set_window_size(2 * width - inner_w, 2 * height - inner_h)
    return driver
