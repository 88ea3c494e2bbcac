"""rope (CUDA): the rotary position embedding in place, as pyml.package.cpu.rope (whose
rope_tables fills the tables on the host)."""

from numba import cuda


@cuda.jit
def rotate_kernel(x, cos, sin, positions_offset, direction):
    # one thread per (b, t, h, i) pair; direction 1 rotates forward, -1 by the transposed rotation
    index = cuda.grid(1)
    n_tokens, n_heads, half = x.shape[1], x.shape[2], cos.shape[1]
    if index < x.shape[0] * n_tokens * n_heads * half:
        i = index % half
        h = (index // half) % n_heads
        t = (index // (half * n_heads)) % n_tokens
        b = index // (half * n_heads * n_tokens)
        pos = positions_offset + t
        c = cos[pos, i]
        s = sin[pos, i] * direction
        x1 = x[b, t, h, i]
        x2 = x[b, t, h, i + half]
        x[b, t, h, i] = x1 * c - x2 * s
        x[b, t, h, i + half] = x2 * c + x1 * s


def rope_forward(x, cos, sin, positions_offset):
    # x is (B, T, H, head_dim), rotated in place; token t sits at position positions_offset + t
    if positions_offset + x.shape[1] > cos.shape[0]:
        raise ValueError("sequence longer than the rope tables' max_seq_len")
    pairs = x.shape[0] * x.shape[1] * x.shape[2] * cos.shape[1]
    rotate_kernel[(pairs + 255) // 256, 256](x, cos, sin, positions_offset, 1)


def rope_backward(dx, cos, sin):
    # the transposed rotation (sin -> -sin), in place (Lean law rotation_adjoint)
    pairs = dx.shape[0] * dx.shape[1] * dx.shape[2] * cos.shape[1]
    rotate_kernel[(pairs + 255) // 256, 256](dx, cos, sin, 0, -1)
