"""Reading a spec file: TOML, then the Pydantic models, then the shape check.

Every failure becomes one `PymlError` line that starts with the spec's path, so the CLI can print it
and exit 2. A spec that loads has passed the shape check: nothing downstream sees a mis-shaped model.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from pydantic import TypeAdapter, ValidationError

from pyml.errors import PymlError
from pyml.spec.layers import BLOCK_LAYER_KINDS, SEQUENTIAL_LAYER_KINDS
from pyml.spec.models import DecoderModel, ModelSpec, SequentialModel

MODEL_SPEC = TypeAdapter(ModelSpec)
FORMS = ("sequential", "decoder")
# Pydantic puts the tag of a discriminated union into error locations; users never wrote it.
UNION_TAGS = frozenset(FORMS) | frozenset(SEQUENTIAL_LAYER_KINDS) | frozenset(BLOCK_LAYER_KINDS)


def describe_location(loc: tuple, data: dict) -> str:
    """`('layers', 1, 'linear', 'bias')` -> `layers[1] (fc2).bias`, naming the layer where it has one."""
    text, node = "", data
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
            node = node[part] if isinstance(node, list) and part < len(node) else None
            if isinstance(node, dict) and isinstance(node.get("name"), str):
                text += f" ({node['name']})"
        elif part in UNION_TAGS and not (isinstance(node, dict) and part in node):
            continue
        else:
            text += f".{part}" if text else str(part)
            node = node.get(part) if isinstance(node, dict) else None
    return text


def describe_error(error: dict, data: dict) -> str:
    where = describe_location(tuple(error["loc"]), data)
    kind = error["type"]
    if kind == "extra_forbidden":
        parent, _, key = where.rpartition(".")
        return f"unknown key '{key}'" + (f" in {parent}" if parent else "")
    if kind == "union_tag_invalid":
        key = error["ctx"]["discriminator"].strip("'")
        expected = error["ctx"]["expected_tags"].replace("'", "")
        field = f"{where}.{key}" if where else key
        return f"{field}: unknown {key} '{error['ctx']['tag']}' (expected one of: {expected})"
    if kind == "union_tag_not_found":
        key = error["ctx"]["discriminator"].strip("'")
        return f"{where or 'spec'}: missing '{key}'"
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {message}" if where else message


def parse_spec(data: dict, source: str) -> SequentialModel | DecoderModel:
    """Validate a spec's data and its shapes; raise PymlError naming `source` on any problem."""
    try:
        spec = MODEL_SPEC.validate_python(data)
    except ValidationError as error:
        details = "; ".join(describe_error(e, data) for e in error.errors()[:3])
        raise PymlError(f"{source}: {details}") from None
    mismatches = spec.shape_mismatches()
    if mismatches:
        raise PymlError(f"{source}: " + "; ".join(str(m) for m in mismatches))
    return spec


def load_spec(path: Path | str) -> SequentialModel | DecoderModel:
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PymlError(f"{path}: no such spec file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise PymlError(f"{path}: cannot read spec ({error})") from None
    except tomllib.TOMLDecodeError as error:
        raise PymlError(f"{path}: not valid TOML ({error})") from None
    return parse_spec(data, str(path))
