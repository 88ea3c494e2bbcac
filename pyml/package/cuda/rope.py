"""rope (CUDA): the rotary position embedding in place, as pyml.package.cpu.rope (whose
rope_tables fills the tables on the host)."""

from numba import cuda


@cuda.jit
def rotate_kernel(x, cos, sin, positions, direction):
    # one thread per (b, t, h, i) pair, token t of row b at positions[b, t]; direction 1 rotates
    # forward, -1 by the transposed rotation
    index = cuda.grid(1)
    n_tokens, n_heads, half = x.shape[1], x.shape[2], cos.shape[1]
    if index < x.shape[0] * n_tokens * n_heads * half:
        i = index % half
        h = (index // half) % n_heads
        t = (index // (half * n_heads)) % n_tokens
        b = index // (half * n_heads * n_tokens)
        rotate_pair(x, cos, sin, b, t, h, i, positions[b, t], direction)


@cuda.jit
def rotate_at_kernel(x, cos, sin, position):
    # one thread per (b, h, i) pair of one new token per sequence, at `position`
    index = cuda.grid(1)
    n_heads, half = x.shape[2], cos.shape[1]
    if index < x.shape[0] * n_heads * half:
        i = index % half
        h = (index // half) % n_heads
        b = index // (half * n_heads)
        rotate_pair(x, cos, sin, b, 0, h, i, position, 1)


@cuda.jit(device=True)
def rotate_pair(x, cos, sin, b, t, h, i, pos, direction):
    c = cos[pos, i]
    s = sin[pos, i] * direction
    x1 = x[b, t, h, i]
    x2 = x[b, t, h, i + cos.shape[1]]
    x[b, t, h, i] = x1 * c - x2 * s
    x[b, t, h, i + cos.shape[1]] = x2 * c + x1 * s


def rope_forward(x, cos, sin, positions):
    # x is (B, T, H, head_dim), rotated in place; token t of row b sits at positions[b, t] (B, T)
    pairs = x.shape[0] * x.shape[1] * x.shape[2] * cos.shape[1]
    rotate_kernel[(pairs + 255) // 256, 256](x, cos, sin, positions, 1)


def rope_decode(x, cos, sin, position):
    # x is (B, 1, H, head_dim): one new token per sequence, at `position`, rotated in place
    if position >= cos.shape[0]:
        raise ValueError("sequence longer than the rope tables' max_seq_len")
    pairs = x.shape[0] * x.shape[2] * cos.shape[1]
    rotate_at_kernel[(pairs + 255) // 256, 256](x, cos, sin, position)


def rope_backward(dx, cos, sin, positions):
    # the transposed rotation (sin -> -sin), in place (Lean law rotation_adjoint)
    pairs = dx.shape[0] * dx.shape[1] * dx.shape[2] * cos.shape[1]
    rotate_kernel[(pairs + 255) // 256, 256](dx, cos, sin, positions, -1)
