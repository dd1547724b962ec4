"""The demo page in a real Chromium (Debian's `chromium` + `chromium-driver`, driven by selenium)
against the real server: the page loads, Speak streams audio into the page's AudioContext (the
page counts the bytes), Stop closes the session and the engine frees its requests; a
screenshot is kept in the test's tmp directory. Skipped, naming what is missing, when chromium,
chromedriver or selenium is not installed."""

from __future__ import annotations

import json
import shutil
import time
import urllib.request

import pytest

pytestmark = pytest.mark.e2e


def running_requests(base_url: str) -> int:
    with urllib.request.urlopen(base_url + "/v1/engine/stats", timeout=5) as r:
        stats = json.loads(r.read())
    return len(stats["active_request_ids"]) + stats["num_running"] + stats["num_waiting"]


def test_demo_page_speaks_and_stops_in_chromium(server, tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed")
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        pytest.skip("Debian's chromium and chromium-driver packages are not installed")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--autoplay-policy=no-user-gesture-required",
                "--use-fake-device-for-media-stream"):
        opts.add_argument(arg)
    browser = webdriver.Chrome(options=opts, service=webdriver.ChromeService(executable_path=driver_path))
    try:
        browser.get(server.base_url + "/")
        deadline = time.monotonic() + 10
        while not browser.execute_script("return document.querySelectorAll('#voice option').length"):
            assert time.monotonic() < deadline, "voices never loaded"
            time.sleep(0.1)
        browser.execute_script("document.getElementById('text').value = 'Hello there. ' + 'This keeps going. '.repeat(20)")
        browser.find_element("id", "speak").click()
        deadline = time.monotonic() + 30
        while not browser.execute_script("return window.audioBytes || 0"):
            assert time.monotonic() < deadline, browser.find_element("id", "log").text
            time.sleep(0.1)
        assert int(browser.find_element("id", "bytes").text) > 0
        browser.save_screenshot(str(tmp_path / "demo_page.png"))
        browser.find_element("id", "stop").click()
        deadline = time.monotonic() + 10
        while "closed" not in browser.find_element("id", "log").text:
            assert time.monotonic() < deadline, browser.find_element("id", "log").text
            time.sleep(0.1)
    finally:
        browser.quit()
    assert (tmp_path / "demo_page.png").stat().st_size > 0
    deadline = time.monotonic() + 10
    while running_requests(server.base_url):
        assert time.monotonic() < deadline, "the engine still runs the stopped session's requests"
        time.sleep(0.2)
