"""The generator fuzzer (generator_fuzz_cases.py: random specs and the regression corpus against
torch) must pass: its child pytest run, started in the background when the session's tests are
collected (tests/support/background_runs.py), is reported here."""

import pytest

from tests.support import background_runs


@pytest.mark.parametrize("cases", [background_runs.FUZZ_CASES])
def test_generator_fuzz_cases_pass(cases):
    status, output = background_runs.runs.result(cases)
    assert status == 0, output[-9000:]
