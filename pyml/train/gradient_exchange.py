"""Combining the ranks' gradients, and the optimizer that shards its state across them (ZeRO-1).

The flat gradient buffer is cut into pieces: at the bucket boundaries the model reports
(`model.grad_buckets`, in the order its backward pass finishes them) and every `PIECE_ELEMENTS`
within a bucket. Each piece is split evenly into one part per rank. Reducing a piece is a
reduce-scatter: every rank sends part r of its gradient to rank r (`Ialltoallv`), and rank r sums
the copies it received, weighted, in rank order (`rank_ordered_sum`). Without sharding an
`Iallgatherv` then hands every reduced part to every rank; with sharding each rank keeps only its
parts, updates its slice of the AdamW state and parameters there, and the parameters are gathered.

Why the sum is ours and not MPI's: MPI moves the bytes, but the order in which an MPI library adds
floating-point contributions is its own choice. The standard only recommends that a reduction give
the same result every time (MPI 4.1, 6.9.1), and MPICH's tree algorithms add a commutative
operation's contributions in the order they arrive (`iallreduce_tsp_tree.c`: "reduction order does
not matter"), which is timing. Here MPI only copies; the arithmetic is one kernel with a fixed
order, so a step gives the same bits whatever the timing, the MPI library or its algorithm
choice. The bytes on the wire are those of a ring all-reduce: each rank sends (N - 1) / N of the
buffer in the reduce-scatter and again in the all-gather.

A piece is started as soon as its bucket is ready and a staging slot is free (`STAGING_SLOTS`
slots of one piece each bound the memory the exchange needs), and advanced whenever the backward
pass reports another bucket; `finish` waits for the rest. Non-blocking collectives must be
started in the same order on every rank: the reduce-scatters go in piece order on one
communicator, the all-gathers in piece order on another.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from pyml.errors import PymlError

# 2 Mi elements (8 MiB of float32): large enough that per-message latency is small next to the
# transfer, small enough that the staging slots stay modest (STAGING_SLOTS pieces, 64 MiB).
PIECE_ELEMENTS = 1 << 21
STAGING_SLOTS = 8


@njit(cache=True, parallel=True)
def rank_ordered_sum(rows, weights, out):
    # rows is (ranks, n): rank r's copy of one part in row r; weights is (ranks,); out is (n,).
    # out[j] = weights[0] * rows[0, j] + weights[1] * rows[1, j] + ..., added in rank order for
    # every j, so the result does not depend on the thread count or on when each copy arrived.
    for j in prange(out.shape[0]):
        total = weights[0] * rows[0, j]
        for r in range(1, rows.shape[0]):
            total += weights[r] * rows[r, j]
        out[j] = total


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of the flat buffers, inside bucket `bucket`; part r of it is
    [bounds[r], bounds[r + 1]) and is reduced on rank r."""

    start: int
    stop: int
    bucket: int
    bounds: tuple[int, ...]

    def counts(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    def offsets(self) -> list[int]:
        return [a - self.start for a in self.bounds[:-1]]

    def part(self, rank: int) -> tuple[int, int]:
        return self.bounds[rank], self.bounds[rank + 1]


def cut_pieces(buckets, size: int, ranks: int) -> list[Piece]:
    """The pieces of a flat buffer of `size` elements, bucket by bucket in the order given."""
    covered = sorted((int(start), int(stop)) for start, stop in buckets)
    edges = [0] + [edge for start, stop in covered for edge in (start, stop)] + [size]
    if any(a != b for a, b in zip(edges[::2], edges[1::2])) or any(a >= b for a, b in covered):
        raise PymlError(
            f"the model's grad_buckets {list(buckets)} are not disjoint non-empty ranges covering "
            f"its {size} gradients; regenerate its package with `pyml gen`"
        )
    pieces = []
    for index, (start, stop) in enumerate(buckets):
        for piece_start in range(start, stop, PIECE_ELEMENTS):
            piece_stop = min(stop, piece_start + PIECE_ELEMENTS)
            length = piece_stop - piece_start
            bounds = tuple(piece_start + length * r // ranks for r in range(ranks + 1))
            pieces.append(Piece(piece_start, piece_stop, index, bounds))
    return pieces


class GradientExchange:
    """Reduces `model.grads.flat` across the ranks of `world`, piece by piece, as the backward pass
    reports buckets. One step: `start_step(weights)`, `bucket_ready(i)` for every bucket (the
    model's `on_grads_ready`), then `finish()`. After it, every rank holds the weighted sum of all
    ranks' gradients, or with `sharded` only its own parts of it (`my_parts`)."""

    def __init__(self, world, model, sharded: bool):
        if model.device.name != "cpu":
            raise PymlError(
                "training on more than one rank runs on the CPU today: --device cuda needs a "
                "CUDA-aware MPI or NCCL behind the gradient exchange (see the README)"
            )
        self.world, self.sharded = world, sharded
        self.grads, self.params = model.grads.flat, model.params.flat
        self.pieces = cut_pieces(model.grad_buckets, self.grads.shape[0], world.size)
        self.bucket_count = len(model.grad_buckets)
        self.my_parts = [piece.part(world.rank) for piece in self.pieces]
        longest_part = max(max(piece.counts()) for piece in self.pieces)
        slots = min(STAGING_SLOTS, len(self.pieces))
        self.staging = [np.empty(world.size * longest_part, self.grads.dtype) for _ in range(slots)]
        # one communicator per kind of collective: each sees its operations in piece order
        self.reduce_comm, self.gather_comm = world.comm.Dup(), world.comm.Dup()

    def start_step(self, weights) -> None:
        """Begin a step whose rank r contributes `weights[r]` times its gradient."""
        self.weights = np.asarray(weights, self.grads.dtype)
        self.ready = [False] * self.bucket_count
        self.next_piece = 0
        self.reducing = deque()  # (piece index, slot, request), oldest first
        self.gathering = []

    def bucket_ready(self, index: int) -> None:
        self.ready[index] = True
        self.progress()

    def all_buckets_ready(self) -> None:
        """Mark every bucket ready: after a failed backward, so that every rank still starts the
        same collectives (the step is then abandoned)."""
        self.ready = [True] * self.bucket_count
        self.progress()

    def progress(self) -> bool:
        """Advance what can be advanced without waiting; True while anything is in flight."""
        MPI = self.world.MPI
        while True:
            advanced = False
            while self.reducing and self.reducing[0][2].Test():
                index, slot, _ = self.reducing.popleft()
                self.sum_part(index, slot)
                if not self.sharded:
                    self.gathering.append(self.start_gather(self.gather_comm, self.grads, index))
                advanced = True
            while (
                self.next_piece < len(self.pieces)
                and self.ready[self.pieces[self.next_piece].bucket]
                and len(self.reducing) < len(self.staging)
            ):
                index = self.next_piece
                slot = index % len(self.staging)
                self.reducing.append((index, slot, self.start_reduce(index, slot)))
                self.next_piece += 1
                advanced = True
            if not advanced:
                break
        if self.gathering and MPI.Request.Testall(self.gathering):
            self.gathering = []
        return bool(self.reducing or self.gathering or self.next_piece < len(self.pieces))

    def start_reduce(self, index: int, slot: int):
        piece, ranks = self.pieces[index], self.world.size
        a, b = piece.part(self.world.rank)
        staging = self.staging[slot][: ranks * (b - a)]
        send = [self.grads[piece.start : piece.stop], (piece.counts(), piece.offsets())]
        receive = [staging, ([b - a] * ranks, [r * (b - a) for r in range(ranks)])]
        return self.reduce_comm.Ialltoallv(send, receive)

    def sum_part(self, index: int, slot: int) -> None:
        a, b = self.pieces[index].part(self.world.rank)
        rows = self.staging[slot][: self.world.size * (b - a)].reshape(self.world.size, b - a)
        rank_ordered_sum(rows, self.weights, self.grads[a:b])

    def start_gather(self, comm, flat, index: int):
        """Hand every rank's part of piece `index` of `flat` to every rank, in place."""
        piece = self.pieces[index]
        part = [flat[piece.start : piece.stop], (piece.counts(), piece.offsets())]
        return comm.Iallgatherv(self.world.MPI.IN_PLACE, part)

    def finish(self) -> None:
        """Wait until every piece of this step is reduced (and, without sharding, gathered)."""
        self.world.wait_until(
            lambda: not self.progress(),
            f"the gradient exchange {self.world.context} did not complete: a rank sent nothing",
        )

    def gather_parameters(self) -> None:
        """After a sharded update: every rank's parts of the parameters to every rank."""
        requests = [
            self.start_gather(self.gather_comm, self.params, index)
            for index in range(len(self.pieces))
        ]
        self.world.wait_for(requests, "the parameter all-gather")


class ShardedAdamW:
    """The generated package's AdamW with its state split across the ranks (ZeRO stage 1): each
    rank keeps exp_avg and exp_avg_sq for its own parts of the flat buffer only (about 1/N of
    them), updates those parts of the parameters with the package's kernels, which work on any
    contiguous slice, and the parameters are then all-gathered. Clipping uses the norm of the whole
    reduced gradient, from every rank's sum of squares."""

    def __init__(self, model, exchange: GradientExchange, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=1e-2, max_grad_norm=None):  # fmt: skip
        self.model, self.exchange = model, exchange
        self.lr, self.betas, self.eps = lr, betas, eps
        self.weight_decay, self.max_grad_norm = weight_decay, max_grad_norm
        self.parts = [(a, b) for a, b in exchange.my_parts if b > a]
        self.offsets = np.cumsum([0] + [b - a for a, b in self.parts]).tolist()
        self.exp_avg = model.device.zeros(self.offsets[-1])
        self.exp_avg_sq = model.device.zeros(self.offsets[-1])
        self.step_count = 0
        self.grad_norm = None  # the whole gradient's norm at the last step

    def slices(self):
        """(flat slice, state slice) of every part this rank owns."""
        for (a, b), offset in zip(self.parts, self.offsets):
            yield slice(a, b), slice(offset, offset + b - a)

    def step(self) -> None:
        k, grads, params = self.model.device.kernels, self.model.grads.flat, self.model.params.flat
        squares = sum(k.adamw_grad_norm(grads[flat]) ** 2 for flat, _ in self.slices())
        everyone = self.exchange.world.allgather_floats([squares], "the gradient norm")
        self.grad_norm = math.sqrt(sum(everyone))
        if self.max_grad_norm is not None:
            # torch.nn.utils.clip_grad_norm_: scale by max_norm / (norm + 1e-6) when below 1
            factor = self.max_grad_norm / (self.grad_norm + 1e-6)
            if factor < 1.0:
                for flat, _ in self.slices():
                    k.adamw_scale(grads[flat], factor)
        self.step_count += 1
        for flat, state in self.slices():
            k.adamw_step(params[flat], grads[flat], self.exp_avg[state], self.exp_avg_sq[state],
                         self.lr, self.betas[0], self.betas[1], self.eps, self.weight_decay,
                         self.step_count)  # fmt: skip
        self.exchange.gather_parameters()

    def gathered_state(self) -> dict | None:
        """The whole exp_avg and exp_avg_sq on rank 0 (None elsewhere), for a checkpoint; every
        rank must call it. Between steps the gradient buffer is free: rank 0 gathers exp_avg into
        it, so that a checkpoint costs it one buffer of the parameters' size, as without sharding
        (the result is valid until the next backward pass)."""
        exchange, world = self.exchange, self.exchange.world
        state = {}
        for name in ("exp_avg", "exp_avg_sq"):
            mine = self.model.device.to_host(getattr(self, name))  # this rank's parts, in order
            whole = None
            if world.rank == 0:
                whole = self.model.grads.flat if name == "exp_avg" else np.empty_like(self.model.grads.flat)
            requests, offset = [], 0
            for piece, (a, b) in zip(exchange.pieces, exchange.my_parts):
                receive = None
                if whole is not None:
                    receive = [whole[piece.start : piece.stop], (piece.counts(), piece.offsets())]
                requests.append(
                    exchange.gather_comm.Igatherv(mine[offset : offset + b - a], receive, root=0)
                )
                offset += b - a
            world.wait_for(requests, "gathering the optimizer state")
            state[name] = whole
        return state if world.rank == 0 else None

    def load_state(self, state, step_count):
        for flat, part in self.slices():
            self.model.device.to_device(state["exp_avg"][flat], self.exp_avg[part])
            self.model.device.to_device(state["exp_avg_sq"][flat], self.exp_avg_sq[part])
        self.step_count = step_count
