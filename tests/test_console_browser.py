"""The console as a person uses it, in a real headless Chromium, against a running fleet:
Mosquitto, the ingest and rollout service, SimAgent devices (tests/support/rollout.py) and
the API and console (tests/support/api.py). Screenshots: test-artifacts/console/."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Iterator

import httpx
import pytest
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from fleet.access import Principal
from fleet.changes import Changes
from tests.support.api import Api, running_api
from tests.support.browser import chromium, shot, until
from tests.support.fleet import Publisher, state, telemetry
from tests.support.mosquitto import Mosquitto
from tests.support.rollout import SITE, Fleet, fleet, model_bundle

pytestmark = pytest.mark.peers

XSS = "<img src=x onerror=alert(1)>"
PASSWORD = "correct horse battery"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, Api]]:
    tmp = tmp_path_factory.mktemp("console")
    broker = Mosquitto(tmp / "broker")
    broker.start()
    labels = {f"dev-0{i}": ("a" if i < 2 else "b", "normal") for i in range(4)}
    try:
        with (
            fleet(tmp, broker, 4, labels=labels) as f,
            running_api(f.store_url, f.artifacts) as api,
        ):
            st = api.store()
            try:
                changes = Changes(st, Principal("cli:test", "admin", "cli"))
                changes.add_user("olga", "operator", PASSWORD)
                changes.add_user("vic", "viewer", PASSWORD)
                st.register_device(XSS, SITE)
            finally:
                st.close()
            _chart_device(broker)
            yield f, api
    finally:
        broker.stop()


def _chart_device(broker: Mosquitto) -> None:
    """A device that publishes telemetry over MQTT (SimAgents send decisions only)."""
    pub = Publisher("127.0.0.1", broker.port)
    boot = uuid.uuid4().hex
    now = time.time_ns()
    pub.send(state("chart-dev", boot, 0))
    for s in range(1, 121):
        pub.send(telemetry("chart-dev", boot, s, now - (121 - s) * 10_000_000_000))
    pub.close()


def sign_in(driver: WebDriver, api: Api, user: str, path: str = "/") -> None:
    driver.get(api.base + path)
    until(lambda: driver.find_element(By.ID, "signin"), 20, "the sign-in page")
    driver.find_element(By.NAME, "user").send_keys(user)
    driver.find_element(By.NAME, "password").send_keys(PASSWORD)
    driver.find_element(By.ID, "signin").click()
    until(lambda: driver.find_element(By.ID, "who"), 20, "signed in")


def test_sign_in_and_the_devices_of_the_running_fleet(world: tuple[Fleet, Api]) -> None:
    f, api = world
    with chromium() as driver:
        driver.get(api.base + "/devices")
        assert "/signin" in driver.current_url  # not signed in: sent to sign in
        driver.find_element(By.NAME, "user").send_keys("olga")
        driver.find_element(By.NAME, "password").send_keys("wrong horse battery")
        driver.find_element(By.ID, "signin").click()
        # The refusal is a new page (the password hash takes a moment): wait for it.
        until(lambda: driver.find_elements(By.ID, "error"), 15, "the sign-in refusal")
        assert driver.find_element(By.ID, "error").text == "wrong user name or password"
        shot(driver, "signin")
        sign_in(driver, api, "olga", "/devices")
        assert driver.current_url.endswith("/devices")
        cookie = driver.get_cookie("efsession")
        assert cookie is not None
        assert cookie["httpOnly"]
        page = httpx.get(api.base + "/devices", cookies={"efsession": cookie["value"]})
        assert page.status_code == 200
        # Scripts only from the server itself (default-src 'self'), never framed.
        assert page.headers["content-security-policy"].startswith("default-src 'self';")
        assert page.headers["x-frame-options"] == "DENY"
        rows = driver.find_elements(By.CSS_SELECTOR, "#devices tbody tr")
        shown = {r.get_attribute("data-device"): r for r in rows}
        for name in f.agents:
            assert shown[name].find_element(By.CSS_SELECTOR, ".state").text == "online"
        shot(driver, "devices")
        driver.get(api.base + "/")
        assert int(driver.find_element(By.ID, "online-count").text) >= len(f.agents)
        shot(driver, "overview")


def test_the_xss_device_name_is_text_everywhere(world: tuple[Fleet, Api]) -> None:
    _, api = world
    with chromium() as driver:
        sign_in(driver, api, "olga", "/devices")
        cell = driver.find_element(By.CSS_SELECTOR, f'#devices tr[data-device="{XSS}"] td a')
        assert cell.text == XSS
        assert not driver.find_elements(By.CSS_SELECTOR, "#devices img")
        cell.click()
        until(lambda: driver.find_element(By.ID, "device-name").text == XSS, 20, "its page")
        assert not driver.find_elements(By.CSS_SELECTOR, "main img")
        with pytest.raises(NoAlertPresentException):
            driver.switch_to.alert.text  # noqa: B018 - an onerror=alert(1) that ran would be here
        shot(driver, "device-xss")


def test_a_device_page_draws_its_telemetry(world: tuple[Fleet, Api]) -> None:
    _, api = world
    with chromium() as driver:
        sign_in(driver, api, "vic", "/devices/chart-dev")

        def drawn() -> bool:
            plots = driver.execute_script(
                "return (window.edgefleetPlots || []).map(p => p.edgefleet.points)"
            )
            return len(plots) == 2 and all(n > 0 for n in plots)

        until(drawn, 30, "two charts with points")
        assert driver.find_elements(By.CSS_SELECTOR, "#charts canvas")
        shot(driver, "device-chart")
        with chromium(768, 1024) as tablet:
            sign_in(tablet, api, "vic", "/devices/chart-dev")
            until(drawn_in(tablet), 30, "the charts on a tablet")
            shot(tablet, "device-chart-tablet")


def drawn_in(driver: WebDriver) -> Callable[[], object]:
    return lambda: driver.execute_script("return (window.edgefleetPlots || []).length === 2")


def _operator(api: Api) -> httpx.Client:
    return api.client("operator")


def test_a_rollout_advances_live_and_pause_is_audited(world: tuple[Fleet, Api]) -> None:
    f, api = world
    bundle, _ = model_bundle(f, "live")
    with _operator(api) as c:
        files = {"bundle": ("live.efb", bundle.read_bytes())}
        r = c.post("/api/v1/rollouts", data={"select": "group=a", "waves": "50%,100%",
                                             "min_devices": "1"}, files=files)  # fmt: skip
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        # Held paused while the page opens, so what the page shows next can only come live.
        assert c.post(f"/api/v1/rollouts/{rid}/pause").status_code == 200
        until(lambda: c.get(f"/api/v1/rollouts/{rid}").json()["state"] == "paused", 30,
              "the rollout paused")  # fmt: skip
    with chromium() as driver:
        sign_in(driver, api, "olga", f"/rollouts/{rid}")
        assert driver.find_element(By.ID, "rollout-state").text == "paused"
        driver.execute_script("window.__same_page = true")
        with _operator(api) as c:
            assert c.post(f"/api/v1/rollouts/{rid}/resume").status_code == 200

        def done() -> bool:
            counts = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#waves .counts")]
            return counts == ["1/1 committed", "1/1 committed"]

        until(done, 120, "both waves committed on the open page")
        assert driver.execute_script("return window.__same_page === true")  # no reload
        until(lambda: driver.find_element(By.ID, "rollout-state").text == "completed", 30,
              "the state completed")  # fmt: skip
        shot(driver, "rollout-completed")
    bundle2, _ = model_bundle(f, "paused", version="1.2.0", counter=3)
    with _operator(api) as c:
        r = c.post("/api/v1/rollouts", data={"select": "group=b", "waves": "50%,100%"},
                   files={"bundle": ("paused.efb", bundle2.read_bytes())})  # fmt: skip
        assert r.status_code == 200, r.text
        rid2 = r.json()["id"]
    with chromium() as driver:
        sign_in(driver, api, "olga", f"/rollouts/{rid2}")
        driver.find_element(By.ID, "pause").click()
        alert = driver.switch_to.alert
        assert alert.text == f"Pause rollout {rid2}?"
        alert.accept()
        until(lambda: driver.find_element(By.ID, "action-result").text == "pause requested",
              20, "the pause to be accepted")  # fmt: skip
        shot(driver, "rollout-paused")
        driver.get(api.base + "/audit")
        rows = [r.text for r in driver.find_elements(By.CSS_SELECTOR, "#audit tbody tr")]
        assert any("olga" in r and "rollout.pause" in r and rid2 in r for r in rows), rows
        shot(driver, "audit")


def test_a_viewer_sees_no_pause_and_the_api_refuses_it(world: tuple[Fleet, Api]) -> None:
    _, api = world
    with _operator(api) as c:
        rollouts = c.get("/api/v1/rollouts").json()
    rid = rollouts[0]["id"] if rollouts else "r1"
    with chromium() as driver:
        sign_in(driver, api, "vic", f"/rollouts/{rid}")
        assert not driver.find_elements(By.ID, "pause")
        assert not driver.find_elements(By.CSS_SELECTOR, 'a[href="/audit"]')
        answer = driver.execute_async_script(
            """const done = arguments[arguments.length - 1];
            const csrf = document.querySelector('meta[name="csrf"]').content;
            fetch('/api/v1/rollouts/' + arguments[0] + '/pause',
                  {method: 'POST', headers: {'X-CSRF-Token': csrf}})
              .then(r => r.json().then(b => done([r.status, b])));""",
            rid,
        )
        assert answer[0] == 403, answer
        assert json.dumps(answer[1]).find("needs the operator role") > 0
        shot(driver, "rollout-viewer")
