"""`pyml serve`'s chat page (GET /) in a real browser: Debian's chromium, headless, driven by
selenium through Debian's chromedriver (`make test` installs both where it can; they are anchors:
tests/support/anchors.py). A message typed into the page is answered in the page, streamed from
the server's API: greedy, the text is `pyml generate`'s; a second message carries the conversation;
a refused request shows the server's error in the page."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

from pyml.formats.chat_template import ChatTemplate
from pyml.generate import decoding
from tests.support import anchors
from tests.support.server_process import started

DEBIAN_CHROMIUM = "apt-get install chromium chromium-driver (make browser, as root)"


@pytest.fixture(scope="module")
def page(tiny_folders):
    """(the folder, a headless chromium showing the server's chat page)."""
    chromium = anchors.program("chromium", DEBIAN_CHROMIUM)
    chromedriver = anchors.program("chromedriver", DEBIAN_CHROMIUM)
    folder = tiny_folders["llama"]
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    # chromium binds a Unix socket under TMPDIR and its profile; such a path holds at most 107 bytes,
    # which a deep TMPDIR (make mutants' scratch tree) exceeds: its files go to a short folder
    scratch = Path(tempfile.mkdtemp(prefix="pyml-chromium-", dir="/tmp"))
    # a closed network: no background connections, no sandbox (as root), a fresh profile
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", f"--user-data-dir={scratch / 'profile'}"):
        options.add_argument(flag)
    # chromedriver unpacks into TMPDIR, which must exist: the test's own folder
    service = webdriver.ChromeService(chromedriver, env=dict(os.environ, TMPDIR=str(scratch)))
    process, url = started(folder)
    try:
        browser = webdriver.Chrome(options=options, service=service)
        try:
            browser.get(url)
            yield folder, browser
        finally:
            browser.quit()
    finally:
        process.terminate()
        shutil.rmtree(scratch, ignore_errors=True)
        assert process.wait(timeout=30) == 0


@functools.cache
def decoder_of(folder: Path):
    return decoding.load_decoder(folder)


def generated_reply(folder: Path, conversation: list[dict], max_tokens: int) -> str:
    text = ChatTemplate.of_folder(folder).render(conversation, add_generation_prompt=True)
    tokenizer = decoding.load_tokenizer(folder)
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    decoder = decoder_of(folder)
    room = decoder.model.MAX_SEQ_LEN - len(ids)  # the server stops at the context's end
    return decoding.generate(decoder, tokenizer, ids, min(max_tokens, room), decoding.eos_ids(folder),
                             out=None).text


def settle(browser, count: int):
    """The page's `count`-th answer once it has finished streaming (or failed)."""
    def finished(driver):
        answers = driver.find_elements(By.CSS_SELECTOR, ".message[data-state]")
        if len(answers) >= count and answers[count - 1].get_attribute("data-state") != "streaming":
            return answers[count - 1]
        return False

    return WebDriverWait(browser, 60).until(finished)


def say(browser, text: str, temperature: str = "0", max_tokens: str = "12") -> None:
    for name, value in (("temperature", temperature), ("max-tokens", max_tokens)):
        field = browser.find_element(By.ID, name)
        field.clear()
        field.send_keys(value)
    browser.find_element(By.ID, "input").send_keys(text)
    browser.find_element(By.ID, "send").click()


def test_the_page_streams_pyml_generates_answer_and_keeps_the_conversation(page):
    folder, browser = page
    assert browser.find_element(By.ID, "model").text == folder.resolve().name
    say(browser, "the cat sat on the")
    first = settle(browser, 1)
    conversation = [{"role": "user", "content": "the cat sat on the"}]
    expected = generated_reply(folder, conversation, 12)
    assert (first.get_attribute("data-state"), first.text) == ("done", expected.strip())
    say(browser, "and then?")
    second = settle(browser, 2)
    conversation += [{"role": "assistant", "content": expected}, {"role": "user", "content": "and then?"}]
    assert (second.get_attribute("data-state"), second.text) == (
        "done", generated_reply(folder, conversation, 12).strip())


def test_a_refused_request_shows_the_servers_error(page):
    _, browser = page
    browser.find_element(By.ID, "clear").click()
    say(browser, "the cat " * 40)  # past the tiny model's context
    answer = settle(browser, 1)
    assert answer.get_attribute("data-state") == "failed"
    assert "the prompt has" in answer.text and "context" in answer.text
