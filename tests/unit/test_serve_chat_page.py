"""The chat page of stages/serve.py in a real browser: headless Chromium (Debian's chromium and
chromium-driver packages, driven by selenium) opens the page, a message is typed and sent with
Enter, the answer streams in and equals the API's greedy answer; a second turn carries the first.

Marked slow (it needs the browser, which `.ci/run` installs before the slow tests; tests/browser.py:
skipped without Chromium unless LLM_LIFECYCLE_REQUIRE_BROWSER=1). A screenshot is written to
$LLM_LIFECYCLE_SCREENSHOT_DIR/chat_page.png when that is set."""

from __future__ import annotations

import threading

import pytest

from browser import headless_chromium, screenshot
from checkpoint_fixtures import chat_tokenizer, save_checkpoint
from stages import serve

pytestmark = pytest.mark.slow

MAX_TOKENS = 16  # typed into the page's "max tokens" field: two turns fit the context


@pytest.fixture
def browser():
    with headless_chromium() as driver:
        yield driver


@pytest.fixture
def server(tmp_path, tiny_tokenizer_dir):
    model = save_checkpoint(tmp_path / "chat-model", chat_tokenizer(tiny_tokenizer_dir), seed=3)
    running = serve.start(model, max_length=256)
    thread = threading.Thread(target=running.serve_forever, daemon=True)
    thread.start()
    yield running
    serve.stop(running)


def _api_answer(server, messages):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    return client.chat.completions.create(model=server.served.model_id, messages=messages, temperature=0,
                                          max_tokens=MAX_TOKENS).choices[0].message.content


def _send_and_wait(browser, text, turn):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    box = browser.find_element(By.ID, "input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)
    done = f"#log .msg:nth-of-type({2 * turn})[data-state='done']"
    WebDriverWait(browser, 60).until(lambda b: b.find_elements(By.CSS_SELECTOR, done),
                                     message=f"no answer to turn {turn}; the page shows: "
                                             f"{browser.find_element(By.ID, 'log').text!r}")
    bubble = browser.find_element(By.CSS_SELECTOR, done)
    assert "assistant" in bubble.get_attribute("class"), bubble.text  # an error shows in its place
    return bubble.find_element(By.CLASS_NAME, "content").text, bubble.find_element(By.CLASS_NAME, "meta").text


def test_a_message_typed_in_the_page_gets_the_apis_answer(browser, server):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/")
    WebDriverWait(browser, 30).until(lambda b: b.find_element(By.ID, "model").text == server.served.model_id)
    browser.find_element(By.ID, "max_tokens").send_keys(str(MAX_TOKENS))
    first, meta = _send_and_wait(browser, "one two", 1)
    expected = _api_answer(server, [{"role": "user", "content": "one two"}])
    # the page shows text as the browser renders it (trailing whitespace trimmed)
    assert first == expected.strip() and first, (first, expected)
    assert meta.startswith("finish: ") and "tokens" in meta
    second, _ = _send_and_wait(browser, "the apple", 2)
    assert second == _api_answer(server, [{"role": "user", "content": "one two"},
                                          {"role": "assistant", "content": expected},
                                          {"role": "user", "content": "the apple"}]).strip()
    assert [e.text for e in browser.find_elements(By.CSS_SELECTOR, "#log .user")] == ["one two", "the apple"]
    screenshot(browser, "chat_page")


@pytest.fixture
def two_model_server(tmp_path, tiny_tokenizer_dir):
    """One server of two models of different weights, named `left` and `right`."""
    from stages.serving.variants import named_dirs

    tokenizer = chat_tokenizer(tiny_tokenizer_dir)
    dirs = [save_checkpoint(tmp_path / name, tokenizer, seed=seed) for name, seed in (("left", 3), ("right", 5))]
    running = serve.start_models(named_dirs(dirs), max_length=256)
    thread = threading.Thread(target=running.serve_forever, daemon=True)
    thread.start()
    yield running
    serve.stop(running)


def _api_answer_of(server, model, messages):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    return client.chat.completions.create(model=model, messages=messages, temperature=0,
                                          max_tokens=MAX_TOKENS).choices[0].message.content


def test_compare_mode_streams_one_prompt_to_two_models_side_by_side(browser, two_model_server):
    """The selector lists /v1/models; with "compare" on, each message goes to both models at once
    and each column shows its model's answer (the API's), each side keeping its own conversation."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser.get(two_model_server.url + "/")
    WebDriverWait(browser, 30).until(lambda b: len(Select(b.find_element(By.ID, "model")).options) == 2)
    assert [o.text for o in Select(browser.find_element(By.ID, "model")).options] == ["left", "right"]
    browser.find_element(By.ID, "compare").click()
    assert Select(browser.find_element(By.ID, "model2")).first_selected_option.text == "right"
    browser.find_element(By.ID, "max_tokens").send_keys(str(MAX_TOKENS))
    conversations = {"left": [], "right": []}
    for turn, text in enumerate(["one two", "the apple"], start=1):
        box = browser.find_element(By.ID, "input")
        box.send_keys(text)
        box.send_keys(Keys.ENTER)
        done = f"#log .pair:nth-of-type({2 * turn}) .msg[data-state='done']"
        WebDriverWait(browser, 60).until(
            lambda b, done=done: len(b.find_elements(By.CSS_SELECTOR, done)) == 2,
            message=f"no two answers to turn {turn}; the page shows: {browser.find_element(By.ID, 'log').text!r}")
        columns = browser.find_elements(By.CSS_SELECTOR, done)
        shown = {c.find_element(By.CLASS_NAME, "who").text: c.find_element(By.CLASS_NAME, "content").text
                 for c in columns}
        assert all("assistant" in c.get_attribute("class") for c in columns), shown
        for model, history in conversations.items():
            history.append({"role": "user", "content": text})
            expected = _api_answer_of(two_model_server, model, history)
            assert shown[model] == expected.strip() and shown[model], (model, shown, expected)
            history.append({"role": "assistant", "content": expected})
    assert conversations["left"][1] != conversations["right"][1]  # two models, two answers
    screenshot(browser, "chat_page_compare")
