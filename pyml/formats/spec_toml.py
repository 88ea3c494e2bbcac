"""Writing spec data as a TOML spec file laid out as the hand-written ones in specs/ are.

The sections (`[embedding]`, `[block]`, ...) and the tables directly in them (`[block.attention]`)
get headers; a list of layers (tables with a `kind`) is an array of tables (`[[block.layers]]`,
`[[block.layers.body]]`); anything inside a layer, such as `rope = { theta = 10000.0 }` or the
attention `pattern`, is written inline. `tomllib.loads(spec_toml(data))` gives `data` back.
"""

import json
import math


def spec_toml(data: dict[str, object], comment: str) -> str:
    """The TOML text of `data` (str, int, float, bool, tables and lists of them), headed by
    `comment`."""
    # A TOML comment ends at the line's end and may hold no control characters.
    lines = ["# " + "".join(char if char.isprintable() else "?" for char in comment)]
    _table(lines, [], data, depth=0)
    return "\n".join(lines) + "\n"


def _is_layer_list(value: object) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(item, dict) and "kind" in item for item in value)
    )


def _table(lines: list[str], path: list[str], table: dict[str, object], depth: int) -> None:
    """Write `table`'s own keys, then its header tables and arrays of tables. Sections (depth 1)
    and the tables in them (depth 2) have headers; deeper tables are inline."""
    headed = {
        key: value
        for key, value in table.items()
        if (isinstance(value, dict) and depth < 2) or _is_layer_list(value)
    }
    for key, value in table.items():
        if key not in headed:
            lines.append(f"{key} = {_inline(value)}")
    for key, value in headed.items():
        name = ".".join([*path, key])
        if isinstance(value, dict):
            lines += ["", f"[{name}]"]
            _table(lines, [*path, key], value, depth + 1)
        else:
            for layer in value:
                lines += ["", f"[[{name}]]"]
                _table(lines, [*path, key], layer, depth=2)


def _inline(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value)  # 1e-06, 100000.0, inf, -inf: all TOML floats
    if isinstance(value, str):
        # A JSON string is a TOML basic string, except that TOML also wants DEL escaped.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, dict):
        if not value:
            return "{}"
        return "{ " + ", ".join(f"{key} = {_inline(item)}" for key, item in value.items()) + " }"
    if isinstance(value, list):
        if any(isinstance(item, dict) for item in value):
            return "[\n" + "".join(f"  {_inline(item)},\n" for item in value) + "]"
        return "[" + ", ".join(_inline(item) for item in value) + "]"
    raise TypeError(f"a spec holds no {type(value).__name__} values")
