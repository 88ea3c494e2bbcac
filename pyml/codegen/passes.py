"""Rewrites of an op list that every forward pass applies (training, decoding, the fused step).

The backward pass runs on the graph's own ops: a fusion is a faster way to compute a forward, and
the adjoints of the ops it fused are the same.
"""

from __future__ import annotations

from pyml.codegen.ir import Op


def fuse_residual_norms(ops: list[Op]) -> list[Op]:
    """A residual join followed by the RMSNorm that reads its output becomes one
    `residual_rmsnorm` op, whose kernel adds and normalises in one pass over the rows."""
    fused: list[Op] = []
    index = 0
    while index < len(ops):
        op = ops[index]
        following = ops[index + 1] if index + 1 < len(ops) else None
        if (op.kind == "residual" and following is not None and following.kind == "rmsnorm"
                and following.inputs[0] == op.outputs[0]):
            fused.append(Op("residual_rmsnorm", following.prefix, op.inputs,
                            (op.outputs[0], following.outputs[0]), dict(following.params),
                            dict(following.aux)))
            index += 2
        else:
            fused.append(op)
            index += 1
    return fused
