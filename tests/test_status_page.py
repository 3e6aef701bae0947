"""The status page in a real headless browser (Debian's chromium, driven by Selenium) against a live
`fleetbatch gateway up` whose engine emulates a slow device: the clusters render, a running batch's progress moves,
a wrong key is told so, and a screenshot is saved. Its JSON needs the API key like the rest of the API."""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from gateway.grpc_api.auth import deployment_token
from gateway.grpc_api.tls import channel
from load.deployment import LocalDeployment
from protos import fleetbatch_pb2 as pb
from protos import fleetbatch_pb2_grpc as pb_grpc
from tests.harness import wait_until

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


def browser():
    if not (CHROMIUM and DRIVER):
        if os.environ.get("CI"):
            pytest.fail("chromium and chromium-driver are not installed (scripts/setup.sh installs them)")
        pytest.skip("chromium and chromium-driver are not installed (scripts/setup.sh installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(DRIVER), options=options)


def fleet(path: Path) -> Path:
    engine = ["--size", "nano", "--device-cost", "30,0.1,2", "--max-running", "4"]  # a slow emulated device
    path.write_text(
        yaml.safe_dump(
            {"version": 1, "clusters": [{"name": "c1", "capacity_tps": 50, "engine_args": engine}]}
        )
    )
    return path


def get(url: str, key: str) -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_the_status_page_shows_a_running_batch_move(tmp_path):
    driver = browser()
    from selenium.common.exceptions import StaleElementReferenceException

    up = ["--clusters", str(fleet(tmp_path / "clusters.yaml"))]
    try:
        with (
            LocalDeployment(tmp_path / "run", up) as info,
            channel(info["address"], token=deployment_token(info)) as ch,
        ):
            key = Path(info["http_api_key_file"]).read_text().strip()
            page, api = info["status_url"], info["http_url"] + "/fleet/status"
            assert get(api, "wrong") == 401 and get(api, key) == 200
            req = pb.SubmitBatchRequest(batch_id="watched", completion_window="1h")
            for i in range(24):
                req.queries.add(
                    id=f"q{i}", prompt=f"Tell me about river number {i}.", max_tokens=64, forced_length=48
                )
            pb_grpc.BatchServiceStub(ch).SubmitBatch(req, timeout=60)

            driver.get(page + "#key=" + key)
            row = '//tr[@data-batch="watched"]//div[contains(@class, "tokens")]'

            def progress() -> float | None:  # the batch's token progress bar, as the page last drew it
                try:
                    bars = driver.find_elements("xpath", row)
                    return float(bars[0].get_attribute("data-value")) if bars else None
                except StaleElementReferenceException:  # the page redrew the row meanwhile: read again
                    return None

            first = wait_until(lambda: (p := progress()) is not None and [p], 60, "the batch's row")[0]
            moved = wait_until(lambda: (p := progress()) is not None and p > first and [p], 120, "progress")[
                0
            ]
            assert 0 <= first < moved <= 1
            cluster = driver.find_element("xpath", '//tr[@data-cluster="c1"]')
            assert "active" in cluster.text and cluster.find_elements("css selector", ".dot.up")
            assert driver.current_url.endswith("/status")  # the key left the address bar
            shot = Path(os.environ.get("FLEETBATCH_STATUS_SCREENSHOT") or tmp_path / "status.png")
            assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000

            driver.execute_script("sessionStorage.clear()")
            driver.get("about:blank")  # a new load: the same page with another fragment would not reload
            driver.get(page + "#key=wrong")
            error = wait_until(lambda: driver.find_element("id", "error").text, 30, "the refusal")
            assert "refused" in error and driver.find_element("id", "keyform").is_displayed()
            status = json.loads(urllib.request.urlopen(
                urllib.request.Request(api, headers={"Authorization": f"Bearer {key}"}), timeout=30
            ).read())  # fmt: skip
            assert [c["name"] for c in status["clusters"]] == ["c1"] and status["batches"][0][
                "id"
            ] == "watched"
    finally:
        driver.quit()
