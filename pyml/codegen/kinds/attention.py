"""attention: causal (optionally sliding-window) softmax attention of q over k and v heads,
grouped-query; scores = scale · Q Kᵀ and out = P V are matrix products (Lean laws
matmul_adjoint_left and matmul_adjoint_right, the scale smul_adjoint), the softmax non-linear.
Decoding appends the new position's k and v to the layer's cache and attends over it.

The window is 0 for global causal attention (t attends to every j <= t) or W > 0 for
sliding-window attention, t attending to t - W < j <= t (transformers' sliding_window_overlay:
kv_idx > q_idx - sliding_window); W >= T gives the global result, bit for bit. Training rows may
pack several examples: `positions` (B, T) gives each token's position in its example (restarting
at 0 at each), and t attends to j only within its example (`row_start`), as the examples would one
by one; with positions[b, t] = t a row is one sequence. The masks are data to the laws: P is zero
outside them.

The CPU kernels (attention_cpu.py.j2) run in Numba, 4 rows at a time: 4 query rows against 4 key
rows, with 16 sums in registers over head_dim, for the scores S = Q Kᵀ and dP = dO Vᵀ; 4 output
rows at a time for the weighted sums O = P V, dQ = dS K, dV = Pᵀ dO and dK = dSᵀ Q. Only the
blocks that meet the causal window are computed: about half of a full (T x T) product. (Through
OpenBLAS, one batched product per (batch, kv head), the 6 products of a layer at T = 128 cost more
in BLAS's calls and thread hand-offs than in arithmetic.) Each output element is summed by one loop
iteration in a fixed order, so the results do not depend on the thread count. The kernels take
C-contiguous copies of q, k, v and dO and write dq, dk, dv and out through copies: the caller's q,
k, v are strided views of its fused qkv rows, and a strided row does not vectorize (3.6x slower at
SmolLM2's shapes). The CUDA kernels (attention_cuda.py.j2) run one thread per query row (b, h, t)
for the forward and for dq, and one per (b, j, kv head, d) for dk and dv, summing the group's heads
and the rows in order: deterministic, no atomics.
"""

from __future__ import annotations

from pyml.codegen.calls import Act, Call, Code, Grad, Statement, StepInput, kernel
from pyml.codegen.ir import Op
from pyml.codegen.kinds.base import BackwardEnv, ForwardEnv, Kind, aux, inputs


class Attention(Kind):
    name = "attention"
    laws = ("matmul_adjoint_left", "matmul_adjoint_right")
    backward_reads = ("inputs", "aux")
    # rendered per op, its head counts and head size fixed: with them read from the arrays
    # instead, the CPU kernels ran 20-40% slower at SmolLM2's shapes (2026-12-03, best of 7:
    # forward 0.78 against 0.95 ms, backward 1.45 against 1.76, a decode step 0.068 against 0.087)
    template = True

    def forward(self, op: Op, env: ForwardEnv) -> list[Statement]:
        q, k, v = inputs(op)
        y = Act(op.outputs[0])
        window = Code(f"{op.attrs['window']}[l]")
        if env.mode == "train":
            return [kernel(op.prefix, "forward", q, k, v, *aux(op), y, window, Code("s.positions"))]
        index = env.attention_index(op)
        if env.mode == "decode":
            return [Call("c.append", (Code(str(index)), Code("l"), Code("position"), k, v),
                         ("kc", "vc", "n_valid")),
                    kernel(op.prefix, "decode", q, Code("kc"), Code("vc"), Code("n_valid"), y)]
        keys = StepInput(f"{op.prefix}_keys", f"keys[{index}]", "[l]")
        values = StepInput(f"{op.prefix}_values", f"values[{index}]", "[l]")
        if env.target == "cpu":  # each sequence of the batch into its own cache row, at its position
            return env.in_parallel(kernel(op.prefix, "decode_rows", q, k, v, keys, values, Code("rows"),
                                          Code("positions"), window, y))
        return [Call("cache_slot", (window, Code("position")), ("slot", "n_valid")),
                Call("store_slot", (keys, Code("slot"), k)),
                Call("store_slot", (values, Code("slot"), v)),
                *env.in_parallel(kernel(op.prefix, "decode", q, keys, values, Code("n_valid"), y))]

    def adjoint(self, op: Op, env: BackwardEnv) -> list[Statement]:
        dq, dk, dv = (env.input_gradient(op, index, False) for index in range(3))
        return [kernel(op.prefix, "backward", *inputs(op), *aux(op), Grad(op.outputs[0]),
                       dq[0], dk[0], dv[0], Code(f"{op.attrs['window']}[l]"), Code("s.positions")),
                *dq[1], *dk[1], *dv[1]]


KIND = Attention()
