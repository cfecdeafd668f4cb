"""The dashboard in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
driven by Selenium) loads the dashboard of ``shoal api`` over a live 3-server swarm and checks what
it shows against the gateway's JSON: every server and block, the RTT column, the graph (a node per
server, an edge per published RTT, the session's route highlighted) and the load chart (its last
point is ``/api/swarm``'s load). A fourth server joins (its RTTs show within 10 s, though records
refresh only every 60 s here), then a server stops. Screenshots go to ``test-artifacts/gateway/``
(``$SHOAL_TEST_ARTIFACTS`` overrides the folder)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from tests.gateway.conftest import MODEL_ID
from tests.gateway.support import SPANS, MetricsSwarm, gateway

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REFRESH = ("--refresh-period", "60", "--expiry", "180")  # the defaults: records re-signed once a minute
RTT_WITHIN = 10.0  # seconds after a server joins, its RTT column is filled
NONE = "\u2013"  # what an empty cell shows (an en dash)

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
    """A swarm of its own (this test adds and stops servers), with the default record refresh."""
    swarm = MetricsSwarm(chat_model[0]).start(SPANS, REFRESH)
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


def text(driver, selector: str) -> str:
    """The text of the first element ``selector`` finds, read in one go (the page redraws every second)."""
    return driver.execute_script("return document.querySelector(arguments[0]).textContent", selector)


def graph(driver) -> dict:
    """The graph drawn: nodes (peer -> state, on a route, label) and edges ((from, to) -> ms, on a route, label)."""
    script = """
      const g = document.getElementById('graph');
      return {
        nodes: [...g.querySelectorAll('g.node')].map(n => [n.dataset.peer, n.dataset.state, n.dataset.route,
                                                          n.querySelector('text').textContent]),
        edges: [...g.querySelectorAll('g.edge[data-kind=rtt]')].map(e => [e.dataset.from, e.dataset.to,
                                                          +e.dataset.ms, e.dataset.route, e.textContent]),
        routeOnly: g.querySelectorAll('g.edge[data-kind=route]').length};
    """
    drawn = driver.execute_script(script)
    nodes = {
        peer: {"state": state, "route": route == "1", "label": label} for peer, state, route, label in drawn["nodes"]
    }
    edges = {(a, b): {"ms": ms, "route": r == "1", "label": label} for a, b, ms, r, label in drawn["edges"]}
    assert len(nodes) == len(drawn["nodes"]) and len(edges) == len(drawn["edges"]), "no duplicates"
    return {"nodes": nodes, "edges": edges, "route_only": drawn["routeOnly"]}


def chart(driver) -> dict:
    """The charts' last point: its time and, per server, tokens/s and sessions ('' for none)."""
    script = """
      const last = (id) => Object.fromEntries([...document.querySelectorAll('#' + id + ' path.series')]
        .map(p => [p.dataset.peer, p.dataset.last]));
      return {t: document.getElementById('chart-tokens').dataset.lastT,
              t2: document.getElementById('chart-sessions').dataset.lastT,
              tokens: last('chart-tokens'), sessions: last('chart-sessions')};
    """
    return driver.execute_script(script)


def swarm_json(api) -> dict:
    with urllib.request.urlopen(f"{api.url}/api/swarm", timeout=10) as reply:
        return json.loads(reply.read())


def published_rtts(status: dict) -> dict[tuple[str, str], float]:
    """Every RTT a server that is not offline publishes to a server the table lists."""
    servers = [s for m in status["models"] for s in m["servers"]] + status["unverified_servers"]
    listed = {s["peer"] for s in servers}
    return {
        (s["peer"], peer): ms
        for s in servers
        if s["state"] != "offline"
        for peer, ms in s["rtts_ms"].items()
        if peer in listed
    }


def graph_shows(api, driver, edges: set[tuple[str, str]]) -> dict | None:
    """The graph drawn, once it shows exactly the servers and published RTTs of ``/api/swarm`` now,
    and those RTTs are ``edges``."""
    status, drawn = swarm_json(api), graph(driver)
    servers = {s["peer"]: s["state"] for m in status["models"] for s in m["servers"]}
    if {p: n["state"] for p, n in drawn["nodes"].items()} != servers:
        return None
    published = published_rtts(status)
    if {e: d["ms"] for e, d in drawn["edges"].items()} != published or set(published) != edges:
        return None
    return drawn


class Stream:
    """A long streamed chat through the gateway, in a thread, until :meth:`close`."""

    def __init__(self, api):
        client = openai.OpenAI(base_url=f"{api.url}/v1", api_key="none", max_retries=0, timeout=60)
        self.stop, self.error = threading.Event(), None
        messages = [{"role": "user", "content": "Tell me a long story."}]

        def consume() -> None:
            try:
                stream = client.chat.completions.create(
                    model=MODEL_ID, messages=messages, temperature=0, max_tokens=900, stream=True
                )
                for _ in stream:
                    if self.stop.is_set():
                        break
                stream.close()
            except Exception as exc:  # reported by close()
                self.error = exc

        self.thread = threading.Thread(target=consume, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(30)
        assert self.error is None, self.error


def test_dashboard_shows_the_swarm_its_graph_and_load(chat_model, own_swarm, browser):
    from selenium.webdriver.support.ui import WebDriverWait

    with gateway(chat_model[0], own_swarm.ticket) as api:
        browser.get(f"{api.url}/dashboard")
        servers = {s.peer: s for s in own_swarm.servers}
        a, b, c = own_swarm.servers

        def all_online(driver) -> bool:
            shown = rows(driver)
            return set(shown) == set(servers) and all(r["state"] == "online" for r in shown.values())

        WebDriverWait(browser, 30, 0.2).until(all_online)
        assert blocks(browser) == [1] * SPANS[-1][1], "every block shown, each covered once"
        for peer, row in rows(browser).items():
            assert (row["start"], row["end"]) == servers[peer].span
            assert f"[{row['start']}:{row['end']})" in row["cells"][1]
            assert row["cells"][0] == peer[:12]
        assert text(browser, "#swarm") == own_swarm.ticket.swarm_id
        assert MODEL_ID in text(browser, "section.model h2")

        # RTTs to the next span, published long before the first refresh (60 s): a and b have a next hop
        def rtt_cells(driver) -> dict[str, str]:
            return {peer: row["cells"][6] for peer, row in rows(driver).items()}

        WebDriverWait(browser, RTT_WITHIN, 0.2).until(lambda d: all(rtt_cells(d)[s.peer] != NONE for s in (a, b)))
        assert rtt_cells(browser)[c.peer] == NONE
        chain = {(a.peer, b.peer), (b.peer, c.peer)}
        drawn = WebDriverWait(browser, 10, 0.2).until(lambda d: graph_shows(api, d, chain))
        for peer, node in drawn["nodes"].items():
            assert node["label"] == peer[:12]
        for edge in drawn["edges"].values():  # labelled in ms, two decimals
            number, unit = edge["label"].split(" ")
            assert unit == "ms" and len(number.split(".")[1]) == 2 and abs(float(number) - edge["ms"]) <= 0.0051
        browser.save_screenshot(str(artifacts() / "dashboard-3-servers.png"))

        # under load: the chart's last point is /api/swarm's load; the session's route is highlighted
        stream = Stream(api)
        try:

            def busy(driver) -> bool:
                last = chart(driver)
                return all(float(last["tokens"].get(p) or 0) > 0 for p in servers) and all(
                    last["sessions"].get(p) == "1" for p in servers
                )

            WebDriverWait(browser, 20, 0.2).until(busy)

            def same_sample(driver) -> tuple[dict, dict] | None:
                last, status = chart(driver), swarm_json(api)
                same = last["t"] and last["t"] == last["t2"] and float(last["t"]) == status["load_time"]
                return (last, status) if same else None

            last, status = WebDriverWait(browser, 10, 0.05).until(same_sample)
            shown = {s["peer"]: s for m in status["models"] for s in m["servers"]}
            assert set(last["tokens"]) == set(last["sessions"]) == set(servers)
            for peer in servers:
                assert float(last["tokens"][peer]) == shown[peer]["tokens_per_s"] > 0
                assert int(last["sessions"][peer]) == shown[peer]["sessions_active"] == 1
            (route,) = status["graph"]["routes"]
            assert route == [a.peer, b.peer, c.peer]
            drawn = graph(browser)
            assert all(node["route"] for node in drawn["nodes"].values())
            assert all(edge["route"] for edge in drawn["edges"].values()) and drawn["route_only"] == 0
            assert "1 session" in text(browser, "#graph-panel h2")
            browser.save_screenshot(str(artifacts() / "dashboard-under-load.png"))
        finally:
            stream.close()

        # a fourth server joins next to b: its RTT to c, and a's RTT to it, show within RTT_WITHIN s
        d = own_swarm.start([b.span], REFRESH).servers[-1]
        joined = time.monotonic()
        WebDriverWait(browser, RTT_WITHIN, 0.2).until(lambda drv: rtt_cells(drv).get(d.peer, NONE) != NONE)
        both = {(a.peer, b.peer), (a.peer, d.peer), (b.peer, c.peer), (d.peer, c.peer)}
        left = RTT_WITHIN - (time.monotonic() - joined)
        drawn = WebDriverWait(browser, left, 0.2).until(lambda drv: graph_shows(api, drv, both))
        assert len(drawn["nodes"]) == 4

        stopped = a  # the one whose ticket the gateway joined through
        stopped.process.stop()  # SIGTERM: the server announces itself offline, then exits

        def updated(driver) -> bool:
            row = rows(driver).get(stopped.peer)
            return (row is None or row["state"] == "offline") and blocks(driver) == [0, 0, 2, 2, 1, 1]

        WebDriverWait(browser, 30, 0.2).until(updated)
        assert "2 blocks uncovered" in text(browser, "section.model h2")
        others = {p: r["state"] for p, r in rows(browser).items() if p != stopped.peer}
        assert others == {s.peer: "online" for s in own_swarm.servers if s is not stopped}
        assert text(browser, "#via") != stopped.peer[:12]  # pulled through another member
        assert text(browser, "#error") == ""
        rest = {(b.peer, c.peer), (d.peer, c.peer)}
        drawn = WebDriverWait(browser, 10, 0.2).until(lambda drv: graph_shows(api, drv, rest))
        assert drawn["nodes"][stopped.peer]["state"] == "offline"
        browser.save_screenshot(str(artifacts() / "dashboard-server-stopped.png"))
        assert (artifacts() / "dashboard-server-stopped.png").stat().st_size > 10_000
