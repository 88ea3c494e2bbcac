"""What the README shows a newcomer is true: its example spec is the one `pyml init` writes, and
every file and folder it links to exists."""

import re
import tomllib
from pathlib import Path

from pyml.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_example_spec_is_the_one_pyml_init_writes():
    (example,) = re.findall(r"```toml\n(.*?)```", README, flags=re.S)
    template = (ROOT / "pyml" / "project_template" / "specs" / "my_decoder.toml").read_text()
    assert parse_spec(tomllib.loads(example), "README.md") == parse_spec(tomllib.loads(template), "template")


def test_every_link_leads_somewhere():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links
    for link in links:
        assert (ROOT / link).exists(), link


def test_it_stays_a_page_a_newcomer_reads():
    assert len(README.splitlines()) <= 260
