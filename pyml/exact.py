"""Python mirror of the Lean exact model (`lean/PyML/Model.lean`, `lean/PyML/Shape.lean`).

Python ints, vectors as lists, an `m x n` matrix as a list of `m` rows. Each function is named
after its Lean definition (snake_case where the Lean name is camelCase; the comment names it).
The laws are tested on these in `tests/proofs/test_exact_laws.py`: that catches a law stated wrongly,
while `lake build` catches a proof that is wrong. Dims are at least 1 (the tests draw 1..5), so
a matrix's column count is the length of its first row. (`i=i` in a lambda binds the loop index.)
"""

import builtins


def sum(n, f):  # Lean: sum
    return builtins.sum(f(i) for i in range(n))


def dot(a, b):  # Lean: dot
    return sum(len(a), lambda i: a[i] * b[i])


def mat_vec(W, v):  # Lean: matVec
    return [sum(len(v), lambda j, i=i: W[i][j] * v[j]) for i in range(len(W))]


def mat_t_vec(W, g):  # Lean: matTVec
    return [sum(len(g), lambda i, j=j: W[i][j] * g[i]) for j in range(len(W[0]))]


def transpose(A):  # Lean: transpose
    return [[A[i][j] for i in range(len(A))] for j in range(len(A[0]))]


def mat_mul(A, B):  # Lean: matMul
    return [[sum(len(B), lambda k, i=i, j=j: A[i][k] * B[k][j]) for j in range(len(B[0]))] for i in range(len(A))]


def frob(A, B):  # Lean: frob
    return sum(len(A), lambda i: sum(len(A[i]), lambda j: A[i][j] * B[i][j]))


def outer(g, v):  # Lean: outer
    return [[g[i] * v[j] for j in range(len(v))] for i in range(len(g))]


def gather(E, ids):  # Lean: gather
    return [[E[ids[t]][j] for j in range(len(E[0]))] for t in range(len(ids))]


def scatter_add(G, ids, V):  # Lean: scatterAdd (V, the table's row count, is implicit in Lean)
    return [[sum(len(ids), lambda t, r=r, j=j: G[t][j] if ids[t] == r else 0) for j in range(len(G[0]))] for r in range(V)]


def hadamard(a, b):  # Lean: hadamard
    return [a[i] * b[i] for i in range(len(a))]


def smul(c, v):  # Lean: smul
    return [c * v[i] for i in range(len(v))]


def broadcast(T, b):  # Lean: broadcast
    return [[b[j] for j in range(len(b))] for _ in range(T)]


def col_sum(G):  # Lean: colSum
    return [sum(len(G), lambda t, j=j: G[t][j]) for j in range(len(G[0]))]


def vec_add(a, b):  # Lean: vecAdd
    return [a[i] + b[i] for i in range(len(a))]


def rotate(c, s, x1, x2):  # Lean: rotate
    return ([c[i] * x1[i] - s[i] * x2[i] for i in range(len(c))], [s[i] * x1[i] + c[i] * x2[i] for i in range(len(c))])


def rotate_t(c, s, g1, g2):  # Lean: rotateT
    return ([c[i] * g1[i] + s[i] * g2[i] for i in range(len(c))], [c[i] * g2[i] - s[i] * g1[i] for i in range(len(c))])


# Shape.lean. A layer is ("linear", W) with W an o x i matrix, or ("scale", w).
# A chain is ("nil",), ("layer", L, rest) or ("residual", body, rest).


def layer_forward(L, v):  # Lean: Layer.forward
    return mat_vec(L[1], v) if L[0] == "linear" else hadamard(L[1], v)


def layer_backward(L, g):  # Lean: Layer.backward
    return mat_t_vec(L[1], g) if L[0] == "linear" else hadamard(L[1], g)


def layer_transposed(L):  # Lean: Layer.transposed
    return ("linear", transpose(L[1])) if L[0] == "linear" else L


def layer_with_param(L, P):  # Lean: Layer.withParam
    return (L[0], P)


def layer_pairing(L, A, B):  # Lean: Layer.pairing
    return frob(A, B) if L[0] == "linear" else dot(A, B)


def layer_param_grad(L, v, g):  # Lean: Layer.paramGrad
    return outer(g, v) if L[0] == "linear" else hadamard(g, v)


def chain_forward(C, v):  # Lean: Chain.forward
    if C[0] == "nil":
        return v
    if C[0] == "layer":
        return chain_forward(C[2], layer_forward(C[1], v))
    return chain_forward(C[2], vec_add(v, chain_forward(C[1], v)))


def chain_backward(C, g):  # Lean: Chain.backward
    if C[0] == "nil":
        return g
    if C[0] == "layer":
        return layer_backward(C[1], chain_backward(C[2], g))
    return vec_add(chain_backward(C[2], g), chain_backward(C[1], chain_backward(C[2], g)))


def chain_append(C, D):  # Lean: Chain.append
    return D if C[0] == "nil" else (C[0], C[1], chain_append(C[2], D))


def chain_transposed(C):  # Lean: Chain.transposed
    if C[0] == "nil":
        return C
    if C[0] == "layer":
        return chain_append(chain_transposed(C[2]), ("layer", layer_transposed(C[1]), ("nil",)))
    return chain_append(chain_transposed(C[2]), ("residual", chain_transposed(C[1]), ("nil",)))


# Not in the Lean model: where a bf16 kernel (pyml/package/bf16_products.py) rounds its operands,
# the mirror rounds the same integers, so the conformance of bf16 products stays exact.


def round_bf16(n):  # no Lean definition: the integer nearest n with 8 significant bits, ties to even
    magnitude = abs(n)
    drop = max(magnitude.bit_length() - 8, 0)  # the bits bfloat16's 8-bit significand cannot keep
    if drop == 0:
        return n
    unit = 1 << drop
    kept, rest = divmod(magnitude, unit)
    if rest * 2 > unit or (rest * 2 == unit and kept % 2 == 1):
        kept += 1
    return (kept * unit) if n >= 0 else -(kept * unit)


def round_bf16_matrix(A):  # no Lean definition: round_bf16 of every entry
    return [[round_bf16(a) for a in row] for row in A]
