"""The typed spec: valid specs parse to the shapes they declare, every invalid spec is rejected with
its own message, and the shape check blames exactly the junction that is wrong."""

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pyml.errors import PymlError
from pyml.spec import DecoderModel, SequentialModel, load_spec, parse_spec
from pyml.spec.load import MODEL_SPEC
from pyml.spec.shapes import Shape, check_chain

ROOT = Path(__file__).resolve().parents[2]
GOOD_SPECS = sorted((ROOT / "specs").glob("*.toml"))
BAD_SPECS = sorted((ROOT / "specs" / "bad").glob("*.toml"))


def expected_message(path: Path) -> str:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect: "), f"{path} must start with '# expect: <message>'"
    return first.removeprefix("# expect: ")


def test_there_are_specs_of_both_forms():
    forms = {type(load_spec(path)) for path in GOOD_SPECS}
    assert forms == {SequentialModel, DecoderModel}
    assert len(BAD_SPECS) >= 10


@pytest.mark.parametrize("path", GOOD_SPECS, ids=lambda p: p.name)
def test_valid_spec_parses_and_its_chain_has_no_mismatch(path):
    spec = load_spec(path)
    assert spec.shape_mismatches() == []


def test_smollm2_spec_is_smollm2():
    spec = load_spec(ROOT / "specs" / "smollm2_135m.toml")
    attention = spec.block.attention
    assert (spec.embedding.vocab_size, spec.embedding.dim, spec.block.count) == (49152, 576, 30)
    assert (attention.n_heads, attention.n_kv_heads, attention.head_dim) == (9, 3, 64)
    assert attention.rope.theta == 100000.0
    assert spec.block.mlp.hidden == 1536
    assert spec.final_norm.eps == 1e-5 and spec.lm_head.tied
    # the inferred chain: ids -> (B, T, 576) through the blocks -> (B, T, 49152) logits
    _, out, last = check_chain(spec.batch, Shape(spec.batch, None), "input_ids", spec.nodes()[:-1])
    assert (str(out), last) == ("Tensor<B, T, 49152>", "lm_head")


def test_mlp_spec_inferred_shapes():
    spec = load_spec(ROOT / "specs" / "mlp_digits.toml")
    _, out, last = check_chain(spec.batch, Shape(spec.batch, spec.input_dim), "input", spec.nodes())
    assert (str(out), last) == ("Mat<B, 10>", "fc3")


@pytest.mark.parametrize("path", BAD_SPECS, ids=lambda p: p.name)
def test_invalid_spec_is_rejected_with_its_message(path):
    with pytest.raises(PymlError) as error:
        load_spec(path)
    message = str(error.value)
    assert message.startswith(str(path)), message
    assert expected_message(path) in message
    assert "\n" not in message


def test_each_bad_spec_has_its_own_message():
    messages = [expected_message(path) for path in BAD_SPECS]
    assert len(set(messages)) == len(messages)


def test_missing_spec_file_is_a_user_error(tmp_path):
    with pytest.raises(PymlError, match="no such spec file"):
        load_spec(tmp_path / "absent.toml")


def chain_spec(dims: list[int]) -> dict:
    """A sequential spec of linear layers dims[0] -> dims[1] -> ... with a ReLU between them."""
    layers = []
    for i, (fan_in, fan_out) in enumerate(zip(dims, dims[1:])):
        layers.append({"kind": "linear", "name": f"fc{i}", "in_features": fan_in,
                       "out_features": fan_out})
        if i < len(dims) - 2:
            layers.append({"kind": "relu", "name": f"act{i}"})
    return {"form": "sequential", "name": "chain", "input_dim": dims[0], "output_dim": dims[-1],
            "layers": layers}


dims_lists = st.lists(st.integers(1, 512), min_size=2, max_size=7)


@given(dims_lists)
def test_random_valid_chains_pass(dims):
    assert parse_spec(chain_spec(dims), "chain").shape_mismatches() == []


@given(dims_lists, st.data())
def test_one_changed_dim_fails_at_exactly_its_junction(dims, data):
    spec = chain_spec(dims)
    linears = [layer for layer in spec["layers"] if layer["kind"] == "linear"]
    # every feature dim the spec states: each linear's in and out, and the model's in and out
    fields = [("model", "input_dim")] + [(i, key) for i in range(len(linears))
                                         for key in ("in_features", "out_features")]
    fields.append(("model", "output_dim"))
    where, key = data.draw(st.sampled_from(fields))
    target = spec if where == "model" else linears[where]
    target[key] = data.draw(st.integers(1, 512).filter(lambda d: d != target[key]))

    mismatches = MODEL_SPEC.validate_python(spec).shape_mismatches()
    assert len(mismatches) == 1
    junction = (mismatches[0].before, mismatches[0].after)
    names = ["input"] + [f"fc{i}" for i in range(len(linears))] + ["output"]
    if where == "model":
        expected = tuple(names[:2]) if key == "input_dim" else tuple(names[-2:])
    elif key == "in_features":
        expected = (names[where], names[where + 1])
    else:
        expected = (names[where + 1], names[where + 2])
    assert junction == expected
