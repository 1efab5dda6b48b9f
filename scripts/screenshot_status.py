#!/usr/bin/env python3
"""Save a 1280x900 screenshot of a running status page: `python scripts/screenshot_status.py URL OUT.png`.

Used for the README picture. Waits until the page has rendered two snapshots, so the picture is not of an
empty page waiting for its first answer.
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: screenshot_status.py URL OUT.png", file=sys.stderr)
        return 2
    url, out = argv
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    from p2p_diloco.view.browser import headless_chromium

    driver = headless_chromium(1280, 900)
    try:
        driver.get(url)
        # Two refreshes: the first paints the page, the second shows live values (ages, rates) settled.
        WebDriverWait(driver, 30).until(lambda d: int(d.find_element(By.ID, "refreshes").text or 0) >= 2)
        if not driver.save_screenshot(out):
            print(f"could not write {out}", file=sys.stderr)
            return 1
    finally:
        driver.quit()
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
