"""What the README shows a newcomer is true: its example spec is the one `pyml init` writes, its
example chats are what `pyml train --data` reads, and every file and folder it links to exists."""

import re
import tomllib
from pathlib import Path

from pyml.spec import parse_spec
from pyml.train.examples import read_records

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_example_spec_is_the_one_pyml_init_writes():
    (example,) = re.findall(r"```toml\n(.*?)```", README, flags=re.S)
    template = (ROOT / "pyml" / "project_template" / "specs" / "my_decoder.toml").read_text()
    assert parse_spec(tomllib.loads(example), "README.md") == parse_spec(tomllib.loads(template), "template")


def test_the_example_chats_are_read_as_one_chat_a_line(tmp_path):
    (example,) = [block for block in re.findall(r"```\n(.*?)```", README, flags=re.S) if '{"messages"' in block]
    path = tmp_path / "chats.jsonl"
    path.write_text(example, encoding="utf-8")
    records = read_records(path)
    assert [record.shape for record in records] == ["chat"] * len(example.splitlines()) != []


def test_every_link_leads_somewhere():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links
    for link in links:
        assert (ROOT / link).exists(), link


def test_it_stays_a_page_a_newcomer_reads():
    assert len(README.splitlines()) <= 300
