"""The chat page at / in headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
driven by selenium): it loads from the server alone, streams an answer, stops it (the
server counts the request as aborted), keeps a multi-turn history whose prefix the cache
reuses, and shows speed and cached tokens. A screenshot is saved as the test's artifact."""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from serving import MODEL, LiveServer, live_server

from dynalm.models.loader import LoadedModel

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
STEP_DELAY_S = 0.05  # the engine is slowed so an answer is still streaming when stop is pressed


@pytest.fixture(scope="module")
def server(smollm2: LoadedModel) -> Iterator[LiveServer]:
    with live_server(smollm2, ctx=1024) as s:
        step = s.engine.step

        def slow_step() -> list:
            time.sleep(STEP_DELAY_S)
            return step()

        s.engine.step = slow_step  # type: ignore[method-assign]
        yield s


@pytest.fixture
def browser() -> Iterator[Any]:
    if not (CHROMIUM and DRIVER):
        pytest.skip(
            "the chat page test needs Debian's chromium and chromium-driver "
            "(as root: apt-get update && apt-get install -y chromium chromium-driver)"
        )
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument("--window-size=1200,900")
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(DRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(what: str, condition: Callable[[], Any], timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def aborted_requests(server: LiveServer) -> float:
    text = server.http().get("/metrics").text
    m = re.search(r'dynalm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)', text)
    return float(m.group(1)) if m else 0.0


def test_the_page_and_its_files_come_from_the_server(server: LiveServer) -> None:
    http = server.http()
    page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    scripts = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert scripts and all(s.startswith("/static/") for s in scripts), scripts
    for path in scripts:
        assert http.get(path).status_code == 200, path
    missing = http.get("/static/nothing.js")
    assert missing.status_code == 404 and "error" in missing.json()
    assert "/" not in http.get("/openapi.json").json()["paths"]  # no part of the API


def test_chat_page_streams_stops_and_keeps_history(server, browser, tmp_path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    browser.get(f"{server.url}/")
    select = browser.find_element(By.ID, "model")
    wait_for("the model list", lambda: select.get_attribute("value") == MODEL)
    # everything the page loaded came from this server: no CDN, no build step
    resources = browser.execute_script(
        "return performance.getEntriesByType('resource').map(r => r.name)"
    )
    assert resources and all(r.startswith(server.url) for r in resources), resources

    # the Markdown renderer: formatting, code blocks, and no HTML from the text
    html = browser.execute_script(
        "return renderMarkdown(arguments[0])",
        "# Title\n**bold** and `x<y`\n\n- one\n- two\n\n"
        "```python\nif a < b:\n    pass\n```\n<b>no</b>",
    )
    assert "<h1>Title</h1>" in html and "<strong>bold</strong>" in html
    assert "<code>x&lt;y</code>" in html and "<li>one</li><li>two</li>" in html
    assert '<pre><code class="language-python">if a &lt; b:\n    pass</code></pre>' in html
    assert "&lt;b&gt;no&lt;/b&gt;" in html and "<b>" not in html

    browser.find_element(By.ID, "system").send_keys("You are a storyteller.")
    temperature = browser.find_element(By.ID, "temperature")
    browser.execute_script(
        "arguments[0].value = '0'; arguments[0].dispatchEvent(new Event('input'))", temperature
    )
    assert browser.find_element(By.ID, "temperature-value").text == "0.00"
    prompt = browser.find_element(By.ID, "prompt")
    prompt.send_keys("Tell me a long story about a dragon.")
    prompt.send_keys(Keys.SHIFT, Keys.ENTER)  # a new line, nothing sent
    prompt.send_keys("Make it very long.")
    assert prompt.get_attribute("value").count("\n") == 1
    assert not browser.find_elements(By.CSS_SELECTOR, ".message.user")
    aborts = aborted_requests(server)
    prompt.send_keys(Keys.ENTER)  # sends

    answer = wait_for(
        "the answer to start",
        lambda: browser.find_elements(By.CSS_SELECTOR, ".message.assistant .content"),
    )[0]
    first = wait_for("streamed text", lambda: answer.text.strip())
    wait_for("more streamed text", lambda: len(answer.text.strip()) > len(first) + 10)
    browser.find_element(By.ID, "stop").click()
    stats = wait_for(
        "the stopped answer's line", lambda: browser.find_elements(By.CSS_SELECTOR, ".stats")
    )[0]
    assert "stopped" in stats.text, stats.text
    # the server saw the client go: the request was aborted, its pages given back
    wait_for("the abort in /metrics", lambda: aborted_requests(server) == aborts + 1, 30)
    server.wait_idle()

    # a second turn: the history goes with it, and its prefix comes from the cache
    browser.find_element(By.ID, "max-tokens").send_keys("8")
    prompt.send_keys("Thank you!", Keys.ENTER)
    wait_for(
        "the second answer", lambda: len(browser.find_elements(By.CSS_SELECTOR, ".stats")) == 2
    )
    stats = browser.find_elements(By.CSS_SELECTOR, ".stats")[1].text
    m = re.search(r"(\d+) tokens · ([\d.]+) tokens/s · (\d+) of (\d+) prompt tokens cached", stats)
    assert m, stats
    assert int(m.group(1)) == 8 and float(m.group(2)) > 0
    assert 0 < int(m.group(3)) < int(m.group(4)), stats
    assert len(browser.find_elements(By.CSS_SELECTOR, ".message.user")) == 2
    assert browser.find_element(By.ID, "send").is_enabled()

    shot = tmp_path / "chat_page.png"
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    if artifacts := os.environ.get("DYNALM_ARTIFACTS"):
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(artifacts) / shot.name)
    print(f"chat page screenshot: {shot}")
