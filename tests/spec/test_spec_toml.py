"""Spec data written as TOML reads back, with Python's own TOML parser, as the same data, and is laid
out as the hand-written specs are."""

import math
import tomllib

from hypothesis import given
from hypothesis import strategies as st

from pyml.formats.spec_toml import spec_toml

SCALARS = (
    st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=20)
)
KEYS = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
OPTIONS = st.dictionaries(KEYS, SCALARS, max_size=3)
LAYER = st.fixed_dictionaries(
    {"kind": st.sampled_from(["rmsnorm", "attention"])},
    optional={
        "dim": st.integers(1, 10**6),
        "eps": st.floats(1e-12, 1.0),
        "rope": OPTIONS,
        "pattern": st.lists(OPTIONS, min_size=1, max_size=6),
        "name": SCALARS,
    },
)
SPEC = st.fixed_dictionaries(
    {
        "name": st.text(max_size=10),
        "max_seq_len": st.integers(1, 2**40),
        "embedding": st.dictionaries(KEYS, SCALARS, max_size=3),
        "block": st.fixed_dictionaries(
            {
                "count": st.integers(1, 100),
                "layers": st.lists(
                    st.fixed_dictionaries(
                        {"kind": st.just("residual"), "body": st.lists(LAYER, min_size=1, max_size=3)}
                    ),
                    min_size=1,
                    max_size=3,
                ),
                "attention": st.fixed_dictionaries({"dim": st.integers(1, 9), "rope": OPTIONS}),
            }
        ),
    }
)


@given(SPEC, st.text())
def test_any_spec_data_reads_back_the_same(data, comment):
    assert tomllib.loads(spec_toml(data, comment)) == data


def test_layout_of_a_composed_block():
    data = {
        "name": "m",
        "block": {
            "count": 2,
            "layers": [{"kind": "residual", "body": [
                {"kind": "attention", "rope": {"theta": 1e6}, "pattern": [{"window": 4}, {}]},
            ]}],
            "attention": {"dim": 8, "rope": {"theta": 10.0}},
        },
    }
    assert spec_toml(data, "hello").splitlines() == [
        "# hello",
        'name = "m"',
        "",
        "[block]",
        "count = 2",
        "",
        "[[block.layers]]",
        'kind = "residual"',
        "",
        "[[block.layers.body]]",
        'kind = "attention"',
        "rope = { theta = 1000000.0 }",
        "pattern = [",
        "  { window = 4 },",
        "  {},",
        "]",
        "",
        "[block.attention]",
        "dim = 8",
        "rope = { theta = 10.0 }",
    ]


def test_floats_keep_every_bit():
    values = [1e-06, 9.999999974752427e-07, 25.298221281347036, 1e300, 5e-324, -0.0, math.inf]
    read = tomllib.loads(spec_toml({"values": values}, "floats"))["values"]
    assert [v.hex() for v in read] == [v.hex() for v in values]
