"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
driven by Selenium) loads ``shoal dashboard`` over a live 3-server swarm, finds every server and every
block, then sees the page update when a server stops. Screenshots go to ``test-artifacts/gateway/``
(``$SHOAL_TEST_ARTIFACTS`` overrides the folder)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.gateway.support import SPANS, MetricsSwarm, UrlProcess

pytestmark = pytest.mark.timeout(240)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,900",
]


def artifacts() -> Path:
    folder = Path(os.environ.get("SHOAL_TEST_ARTIFACTS") or Path(__file__).parents[2] / "test-artifacts") / "gateway"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (Path(CHROMIUM).is_file() and Path(CHROMEDRIVER).is_file()):
        pytest.fail("needs Debian's chromium and chromium-driver: apt-get install -y chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def own_swarm(chat_model):
    """A swarm of its own: this test stops one of its servers."""
    swarm = MetricsSwarm(chat_model[0]).start()
    try:
        yield swarm
    finally:
        swarm.close()


def rows(driver) -> dict[str, dict]:
    """The server rows shown: peer -> its data attributes and cell texts."""
    script = """
      return [...document.querySelectorAll('tr[data-peer]')].map(r => ({
        peer: r.dataset.peer, state: r.dataset.state, start: +r.dataset.start, end: +r.dataset.end,
        cells: [...r.cells].map(c => c.textContent)}));
    """
    return {row["peer"]: row for row in driver.execute_script(script)}


def blocks(driver) -> list[int]:
    script = "return [...document.querySelectorAll('.block')].map(b => [+b.dataset.block, +b.dataset.coverage]);"
    shown = driver.execute_script(script)
    assert [b for b, _ in shown] == list(range(len(shown))), "blocks in order"
    return [n for _, n in shown]


def test_dashboard_shows_the_swarm_and_follows_a_server_stopping(chat_model, own_swarm, browser):
    from selenium.webdriver.support.ui import WebDriverWait

    dashboard = UrlProcess(
        ["-m", "shoal.cli.main", "dashboard", "--join", str(own_swarm.ticket), "--port", "0", "--bind", "127.0.0.1:0"],
        "dashboard",
    )
    try:
        browser.get(dashboard.url)
        servers = {s.peer: s for s in own_swarm.servers}

        def all_online(driver) -> bool:
            shown = rows(driver)
            return set(shown) == set(servers) and all(r["state"] == "online" for r in shown.values())

        WebDriverWait(browser, 30, 0.2).until(all_online)
        assert blocks(browser) == [1] * SPANS[-1][1], "every block shown, each covered once"
        for peer, row in rows(browser).items():
            assert (row["start"], row["end"]) == servers[peer].span
            assert f"[{row['start']}:{row['end']})" in row["cells"][1]
            assert row["cells"][0] == peer[:12]
        assert browser.find_element("id", "swarm").text == own_swarm.ticket.swarm_id
        assert "tinychat" in browser.find_element("css selector", "section.model h2").text
        browser.save_screenshot(str(artifacts() / "dashboard-3-servers.png"))

        stopped = own_swarm.servers[0]  # the one whose ticket the dashboard joined through
        stopped.process.stop()  # SIGTERM: the server announces itself offline, then exits

        def updated(driver) -> bool:
            row = rows(driver).get(stopped.peer)
            return (row is None or row["state"] == "offline") and blocks(driver) == [0, 0, 1, 1, 1, 1]

        WebDriverWait(browser, 30, 0.2).until(updated)
        assert "2 blocks uncovered" in browser.find_element("css selector", "section.model h2").text
        others = {p: r["state"] for p, r in rows(browser).items() if p != stopped.peer}
        assert others == {s.peer: "online" for s in own_swarm.servers if s is not stopped}
        assert browser.find_element("id", "via").text != stopped.peer[:12]  # pulled through another member
        assert browser.find_element("id", "error").text == ""
        browser.save_screenshot(str(artifacts() / "dashboard-server-stopped.png"))
        assert (artifacts() / "dashboard-server-stopped.png").stat().st_size > 10_000
    finally:
        dashboard.stop()
