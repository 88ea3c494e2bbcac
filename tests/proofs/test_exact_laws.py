"""Every Lean law, tested on the Python mirror of the exact model (`pyml/exact.py`) with random
dims and values. This catches a law stated wrongly; `lake build` catches a proof that is wrong.
Each law in the index (read from the Lean sources) must have a test here, and vice versa."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pyml import exact as X
from pyml.laws import load_law_index

INTS = st.integers(-50, 50)
DIM = st.integers(1, 5)


def vec(data, n):
    return data.draw(st.lists(INTS, min_size=n, max_size=n))


def mat(data, m, n):
    return [vec(data, n) for _ in range(m)]


def draw_layer(data, i, o):
    if i == o and data.draw(st.booleans()):
        return ("scale", vec(data, i))
    return ("linear", mat(data, o, i))


def draw_chain(data, i, k, depth=3):
    """A random well-formed chain from width i to width k."""
    if depth <= 0:
        return ("nil",) if i == k else ("layer", draw_layer(data, i, k), ("nil",))
    kind = data.draw(st.sampled_from(["nil", "layer", "residual"] if i == k else ["layer", "residual"]))
    if kind == "nil":
        return ("nil",)
    if kind == "layer":
        j = data.draw(DIM)
        return ("layer", draw_layer(data, i, j), draw_chain(data, j, k, depth - 1))
    return ("residual", draw_chain(data, i, i, depth - 1), draw_chain(data, i, k, depth - 1))


@given(st.data())
def law_linear_input_adjoint(data):
    m, n = data.draw(DIM), data.draw(DIM)
    W, g, v = mat(data, m, n), vec(data, m), vec(data, n)
    assert X.dot(g, X.mat_vec(W, v)) == X.dot(X.mat_t_vec(W, g), v)


@given(st.data())
def law_matmul_adjoint_left(data):
    m, k, n = data.draw(DIM), data.draw(DIM), data.draw(DIM)
    G, A, B = mat(data, m, n), mat(data, m, k), mat(data, k, n)
    assert X.frob(G, X.mat_mul(A, B)) == X.frob(X.mat_mul(G, X.transpose(B)), A)


@given(st.data())
def law_matmul_adjoint_right(data):
    m, k, n = data.draw(DIM), data.draw(DIM), data.draw(DIM)
    G, A, B = mat(data, m, n), mat(data, m, k), mat(data, k, n)
    assert X.frob(G, X.mat_mul(A, B)) == X.frob(X.mat_mul(X.transpose(A), G), B)


@given(st.data())
def law_linear_weight_adjoint_input(data):
    T, m, k = data.draw(DIM), data.draw(DIM), data.draw(DIM)
    G, Xin, W = mat(data, T, m), mat(data, T, k), mat(data, m, k)
    assert X.frob(G, X.mat_mul(Xin, X.transpose(W))) == X.frob(X.mat_mul(G, W), Xin)


@given(st.data())
def law_linear_weight_adjoint_weight(data):
    T, m, k = data.draw(DIM), data.draw(DIM), data.draw(DIM)
    G, Xin, W = mat(data, T, m), mat(data, T, k), mat(data, m, k)
    assert X.frob(G, X.mat_mul(Xin, X.transpose(W))) == X.frob(X.mat_mul(X.transpose(G), Xin), W)


@given(st.data())
def law_embedding_adjoint(data):
    V, D, T = data.draw(DIM), data.draw(DIM), data.draw(DIM)
    G, E = mat(data, T, D), mat(data, V, D)
    ids = data.draw(st.lists(st.integers(0, V - 1), min_size=T, max_size=T))
    assert X.frob(G, X.gather(E, ids)) == X.frob(X.scatter_add(G, ids, V), E)


@given(st.data())
def law_hadamard_adjoint(data):
    n = data.draw(DIM)
    g, a, b = vec(data, n), vec(data, n), vec(data, n)
    assert X.dot(g, X.hadamard(a, b)) == X.dot(X.hadamard(g, b), a)


@given(st.data())
def law_residual_adjoint(data):
    # f is any map with a known adjoint: a square linear layer W v, adjoint Wᵀ g
    n = data.draw(DIM)
    W, g, v = mat(data, n, n), vec(data, n), vec(data, n)
    lhs = X.dot(g, X.vec_add(v, X.mat_vec(W, v)))
    assert lhs == X.dot(X.vec_add(g, X.mat_t_vec(W, g)), v)


@given(st.data())
def law_smul_adjoint(data):
    n = data.draw(DIM)
    c, g, v = data.draw(INTS), vec(data, n), vec(data, n)
    assert X.dot(g, X.smul(c, v)) == X.dot(X.smul(c, g), v)


@given(st.data())
def law_bias_adjoint(data):
    T, n = data.draw(DIM), data.draw(DIM)
    G, b = mat(data, T, n), vec(data, n)
    assert X.frob(G, X.broadcast(T, b)) == X.dot(X.col_sum(G), b)


@given(st.data())
def law_compose_adjoint(data):
    # f = A (k -> m) and h = B (n -> k): the adjoint of A∘B is Bᵀ∘Aᵀ
    m, k, n = data.draw(DIM), data.draw(DIM), data.draw(DIM)
    A, B, g, v = mat(data, m, k), mat(data, k, n), vec(data, m), vec(data, n)
    lhs = X.dot(g, X.mat_vec(A, X.mat_vec(B, v)))
    assert lhs == X.dot(X.mat_t_vec(B, X.mat_t_vec(A, g)), v)


@given(st.data())
def law_rotation_adjoint(data):
    n = data.draw(DIM)
    c, s, g1, g2, x1, x2 = (vec(data, n) for _ in range(6))
    y1, y2 = X.rotate(c, s, x1, x2)
    t1, t2 = X.rotate_t(c, s, g1, g2)
    assert X.dot(g1, y1) + X.dot(g2, y2) == X.dot(t1, x1) + X.dot(t2, x2)


@given(st.data())
def law_chain_append_forward(data):
    i, j, k = data.draw(DIM), data.draw(DIM), data.draw(DIM)
    C, D, v = draw_chain(data, i, j), draw_chain(data, j, k), vec(data, i)
    assert X.chain_forward(X.chain_append(C, D), v) == X.chain_forward(D, X.chain_forward(C, v))


@given(st.data())
def law_chain_adjoint(data):
    i, k = data.draw(DIM), data.draw(DIM)
    C, g, v = draw_chain(data, i, k), vec(data, k), vec(data, i)
    assert X.dot(g, X.chain_forward(C, v)) == X.dot(X.chain_backward(C, g), v)


@given(st.data())
def law_chain_transposed_forward(data):
    i, k = data.draw(DIM), data.draw(DIM)
    C, g = draw_chain(data, i, k), vec(data, k)
    assert X.chain_forward(X.chain_transposed(C), g) == X.chain_backward(C, g)


@given(st.data())
def law_layer_param_grad_adjoint(data):
    i, o = data.draw(DIM), data.draw(DIM)
    L = draw_layer(data, i, o)
    P = mat(data, o, i) if L[0] == "linear" else vec(data, i)
    v, g = vec(data, i), vec(data, o)
    grad = X.layer_param_grad(L, v, g)
    shape = (lambda p: (len(p), len(p[0]))) if L[0] == "linear" else len
    assert shape(grad) == shape(P)  # the gradient has the parameter's shape
    assert X.dot(g, X.layer_forward(X.layer_with_param(L, P), v)) == X.layer_pairing(L, grad, P)


MIRRORS = {name.removeprefix("law_"): fn for name, fn in dict(globals()).items() if name.startswith("law_")}


def test_every_law_has_a_mirror_test():
    assert set(load_law_index()) == set(MIRRORS)


@pytest.mark.parametrize("name", sorted(MIRRORS))
def test_law_holds_on_the_mirror(name):
    settings(max_examples=60, deadline=None)(MIRRORS[name])()


def test_a_wrongly_stated_law_is_caught():
    # the transposed product on the wrong side: ⟨G, A B⟩ = ⟨Bᵀ G, A⟩ does not even have A's shape
    # in general; on square matrices it has the shape but is false
    A, B, G = [[1, 2], [0, 1]], [[0, 1], [1, 0]], [[1, 0], [0, 0]]
    assert X.frob(G, X.mat_mul(A, B)) != X.frob(X.mat_mul(X.transpose(B), G), A)
