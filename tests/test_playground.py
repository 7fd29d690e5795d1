"""The playground page of `clover serve` in a real browser (issue #45): headless Chromium (Debian's
`chromium` + `chromium-driver`, driven by Selenium) opens `/` of a live `clover serve` on loopback
that has an API key and a Host allow-list, is asked for the key, sends a prompt, and the page shows
the answer, a block with several positions filled in one denoising step, and the settings the server
used; a second turn's required tool call shows as a call. A screenshot is written to
$CLOVER_TEST_ARTIFACTS (or the test's tmp dir)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest
from serve_process import launch

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
if not (os.path.exists(CHROMIUM) and os.path.exists(CHROMEDRIVER)):
    pytest.skip("needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver; "
                ".ci/run installs them)", allow_module_level=True)
webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the test extra)")
from selenium.webdriver.common.by import By                   # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait   # noqa: E402

KEY = "playground-test-key"
TIMEOUT = 120
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def server():
    proc, url, _ = launch(["--threads", "1", "--api-key", KEY, "--allowed-host", "127.0.0.1", "--log-level", "warning"],
                          timeout=TIMEOUT)
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    yield driver
    driver.quit()


def test_the_api_refuses_without_the_key_the_page_loads_under_an_allowed_host(server):
    body = {"model": "clover-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert httpx.post(server + "/v1/chat/completions", json=body, timeout=30).status_code == 401
    assert httpx.get(server + "/v1/models", timeout=30).status_code == 401
    page = httpx.get(server + "/", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for asset in ("/playground/app.js", "/playground/style.css"):
        assert httpx.get(server + asset, timeout=30).status_code == 200
    # the page, like the API, answers only under the names --allowed-host lists (a DNS-rebinding page)
    for path in ("/", "/playground/app.js", "/v1/models"):
        r = httpx.get(server + path, headers={"Host": "elsewhere.example"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"


def set_value(driver, element_id, value):
    element = driver.find_element(By.ID, element_id)
    element.clear()
    element.send_keys(str(value))


def send(driver, prompt):
    """Send `prompt` from the page; the answer's element once it is done."""
    before = len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    set_value(driver, "prompt", prompt)
    driver.find_element(By.ID, "send").click()
    finished = ".msg.assistant[data-state='done'], .msg.assistant[data-state='error']"
    WebDriverWait(driver, TIMEOUT).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, finished)) > before)
    answer = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
    assert answer.get_attribute("data-state") == "done", answer.text
    # the diffusion view draws the steps one by one, a little behind the stream
    WebDriverWait(driver, TIMEOUT).until(lambda d: d.find_element(By.ID, "block").get_attribute("data-pending") == "0")
    return answer


def test_a_prompt_in_the_playground(server, browser, tmp_path):
    driver, wait = browser, WebDriverWait(browser, TIMEOUT)
    driver.get(server + "/")
    key_form = driver.find_element(By.ID, "key-form")
    wait.until(lambda d: key_form.is_displayed())                      # the API said 401: the page asks
    assert not driver.find_element(By.ID, "send").is_enabled()
    set_value(driver, "api-key", KEY)
    driver.find_element(By.CSS_SELECTOR, "#key-form button").click()
    wait.until(lambda d: "clover-demo" in d.find_element(By.ID, "model").text)
    assert not key_form.is_displayed()

    for element_id, value in (("block_size", 16), ("threshold", 0.9), ("max_tokens", 64), ("temperature", 0)):
        set_value(driver, element_id, value)
    answer = send(driver, "What is 17 + 25?")
    thought = driver.execute_script("return document.querySelector('.msg.assistant details.thinking div')"
                                    ".textContent")
    content = answer.find_element(By.CSS_SELECTOR, ".content").text
    assert (thought + content).strip()                                # the answer appeared

    # the diffusion view: some block had more than one position filled by one denoising step
    rows = driver.find_elements(By.CSS_SELECTOR, "#blocks tbody tr")
    assert rows and max(int(r.get_attribute("data-most")) for r in rows) > 1
    assert not driver.find_elements(By.CSS_SELECTOR, "#block .cell:not(.filled)")   # the last block, resolved
    assert driver.find_element(By.ID, "block").get_attribute("data-size") == "16"
    assert len(driver.find_elements(By.CSS_SELECTOR, "#block .cell")) == 16
    # the settings reached the request: the server's echo of what it used
    used = json.loads(driver.find_element(By.ID, "used").get_attribute("data-settings"))
    assert (used["block_size"], used["threshold"], used["max_new_tokens"], used["do_sample"]) == (16, 0.9, 64, False)
    assert "block 16" in driver.find_element(By.ID, "used").text
    assert "tok/s" in driver.find_element(By.ID, "speed").text and "–" not in driver.find_element(By.ID, "speed").text

    # a second turn, thinking off, with a tool the model must call: shown as a call, not as text
    driver.find_element(By.ID, "thinking").click()
    set_value(driver, "tools", json.dumps([ADD]))
    Select(driver.find_element(By.ID, "tool_choice")).select_by_value("required")
    answer = send(driver, "What is 17 + 25?")
    call = answer.find_element(By.CSS_SELECTOR, ".tool-call").text
    assert call.startswith("call add(") and set(json.loads(call[len("call add("):-1])) == {"a", "b"}, call
    assert not answer.find_element(By.CSS_SELECTOR, "details.thinking").is_displayed()
    assert not driver.find_elements(By.CSS_SELECTOR, "#block .cell:not(.filled)")
    assert "thinking off" in driver.find_element(By.ID, "used").text

    folder = Path(os.environ.get("CLOVER_TEST_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    shot = folder / "playground.png"
    assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]]
    assert not errors, errors                                        # no script error, no CSP refusal
