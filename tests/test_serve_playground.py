"""The playground page in a real headless browser (Debian's chromium, driven by selenium):
type a prompt, generate against a live server on a tiny model, and see the answer stream in
as tokens coloured by how they were produced, with the stats filled in. A screenshot is kept
under pytest's tmp dir; its path is printed."""

from __future__ import annotations

import copy
import re
import shutil

import pytest
import torch

pytest.importorskip("fastapi", reason="needs the serve extra: pip install -e '.[serve]'")
webdriver = pytest.importorskip("selenium.webdriver",
                                reason="needs selenium: pip install -e '.[dev]'")

from adaspec.backends.torch.backend import TorchBackend  # noqa: E402
from adaspec.serve.instance import ModelInstance  # noqa: E402

from .conftest import CharTokenizer  # noqa: E402
from .test_serve import SlowBackend, live_server  # noqa: E402

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture
def browser():
    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("needs a headless browser: apt-get install chromium chromium-driver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,860"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(20)
    yield driver
    driver.quit()


@pytest.fixture
def char_instance(target_model):
    """A tiny target (one character per token) whose draft is a noisy copy of it: most
    drafts are accepted, some corrected, so every colour shows. Slowed a little so the
    answer visibly streams."""
    draft_model = copy.deepcopy(target_model)
    with torch.no_grad():
        head = draft_model.get_output_embeddings().weight
        noise = torch.randn(head.shape, generator=torch.Generator().manual_seed(1))
        head.add_(noise * 0.7 * head.std())
    target = SlowBackend(TorchBackend(target_model, name="tiny-target"), delay=0.01)
    draft = TorchBackend(draft_model, name="tiny-draft")
    return ModelInstance(target, CharTokenizer(), draft, [0], "draft:k=3")


def test_the_playground_streams_coloured_tokens_and_stats(browser, char_instance, tmp_path,
                                                          capsys):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    n = 40
    expected = char_instance.engine("draft:k=3").generate("def add(a, b):", n).text
    with live_server(char_instance) as url:
        browser.get(url + "/")
        wait = WebDriverWait(browser, 20)
        wait.until(lambda d: "default method draft:k=3" in d.find_element(By.ID, "server").text)
        prompt = browser.find_element(By.ID, "prompt")
        prompt.clear()
        prompt.send_keys("def add(a, b):")
        tokens = browser.find_element(By.ID, "max-tokens")
        tokens.clear()
        tokens.send_keys(str(n))
        browser.find_element(By.ID, "generate").click()
        wait.until(lambda d: d.find_element(By.ID, "status").text == "done")

        spans = browser.find_elements(By.CSS_SELECTOR, "#output span.tok")
        sources = [s.get_attribute("class").split()[1] for s in spans]
        assert len(spans) == n
        assert sources[0] == "plain"
        assert set(sources) == {"plain", "accepted", "correction", "bonus"}
        assert browser.find_element(By.ID, "output").get_attribute("textContent") == expected
        colours = {s.value_of_css_property("background-color") for s in spans}
        assert len(colours) == 4  # each source its own colour

        stat = {name: browser.find_element(By.ID, "stat-" + name).text
                for name in ("tokens", "tps", "ttft", "steps", "mat", "acceptance", "finish")}
        assert stat["tokens"] == str(n)
        assert stat["finish"] == "length"
        accepted, drafted = map(int, re.search(r"\((\d+)/(\d+)\)", stat["acceptance"]).groups())
        assert 0 < accepted < drafted
        assert stat["acceptance"].startswith(f"{100 * accepted / drafted:.1f}%")
        assert int(browser.find_element(By.ID, "stat-accepted").text) == accepted
        assert float(stat["tps"]) > 0 and float(stat["mat"]) > 1
        assert int(stat["steps"]) < n  # speculation: fewer target calls than tokens
        assert "draft:k=3: prefill" in browser.find_element(By.ID, "stat-split").text

        shot = tmp_path / "playground.png"
        browser.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        with capsys.disabled():  # shown even when pytest captures output
            print(f"\nplayground screenshot: {shot}")


def test_the_playground_shows_an_error_message(browser, char_instance):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with live_server(char_instance) as url:
        browser.get(url + "/")
        method = browser.find_element(By.ID, "method")
        method.send_keys("warp:k=2")
        browser.find_element(By.ID, "generate").click()
        wait = WebDriverWait(browser, 20)
        wait.until(lambda d: "unknown method" in d.find_element(By.ID, "status").text)
        assert browser.find_element(By.ID, "status").get_attribute("class") == "error"


def test_the_playground_sends_the_api_key(browser, char_instance):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with live_server(char_instance, api_key="s3cret") as url:
        browser.get(url + "/")  # the page itself needs no key
        wait = WebDriverWait(browser, 20)
        key = browser.find_element(By.ID, "api-key")
        wait.until(lambda d: key.is_displayed())
        browser.find_element(By.ID, "prompt").clear()
        browser.find_element(By.ID, "prompt").send_keys("def f(x):")  # the tokenizer's letters
        browser.find_element(By.ID, "max-tokens").clear()
        browser.find_element(By.ID, "max-tokens").send_keys("8")
        browser.find_element(By.ID, "generate").click()
        wait.until(lambda d: "API key" in d.find_element(By.ID, "status").text)
        key.send_keys("s3cret")
        browser.find_element(By.ID, "generate").click()
        wait.until(lambda d: d.find_element(By.ID, "status").text == "done")
        assert browser.find_element(By.ID, "stat-tokens").text == "8"
