"""The mutation catalogue stays plantable: every entry's `find` text occurs exactly once in its
file as the code is now (an entry whose text went away with a refactoring would be reported
STALE by `make mutants` instead of testing anything), and its tests exist."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRIES = tomllib.loads((ROOT / "mutants" / "catalogue.toml").read_text())["mutant"]


def test_every_entry_finds_its_text_exactly_once():
    stale = [f"{entry['id']}: {entry['file']} holds its text "
             f"{(ROOT / entry['file']).read_text().count(entry['find'])} times"
             for entry in ENTRIES if (ROOT / entry["file"]).read_text().count(entry["find"]) != 1]
    assert stale == []


def test_entries_are_unique_and_name_test_files_that_exist():
    ids = [entry["id"] for entry in ENTRIES]
    assert len(ids) == len(set(ids))
    missing = [f"{entry['id']}: {test}" for entry in ENTRIES for test in entry["tests"]
               if not (ROOT / test.split("::")[0]).exists()]
    assert missing == []
