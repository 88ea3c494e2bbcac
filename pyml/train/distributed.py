"""Data-parallel training on MPI: `pyml train` under `mpiexec -n N` (or `srun`), or `--ranks N`.

Every rank holds a replica of the model and draws the same deterministic order of global batches;
rank r trains on rows [B r / N, B (r + 1) / N) of each, and the ranks' gradients are combined
(`pyml.train.gradient_exchange`) before the optimizer step. A rank's gradient is the mean over
its own counted targets (a target of -100 is not counted), so rank r is weighted by its share of
the batch's counted targets: the combined gradient and loss are one rank's mean over the whole
batch. Only rank 0 writes checkpoints, the progress bar, the loss curve and logs; a checkpoint
holds the whole state, so a run saved with N ranks resumes with any number.

Nothing here imports mpi4py (or numpy) unless a launcher started several ranks: with one rank
`process_group` gives `SingleProcess` and training runs as it always has.

Faults. Once per step the ranks agree: rank 0 gathers a short status from every rank, within a
timeout, and sends all of them back. A rank whose step failed (bad data, a non-finite loss, any
exception) makes every rank stop there, weights unchanged, and rank 0 prints one line naming it; a
Ctrl-C or SIGTERM that reached any rank makes every rank stop after that step, and rank 0 saves
once. A rank that sends nothing within the timeout is named by rank 0, which ends the job. An error
only one rank sees outside a step (a checkpoint rank 0 cannot write) ends the job through
MPI_Abort, after that rank prints one line naming itself. A rank that dies is reported by the MPI
launcher, which ends the job. Checkpoints are written whole or not at all
(`pyml.train.checkpoint`), so the last complete one survives all of these.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import sys
import time
import traceback
from contextlib import ExitStack, contextmanager, redirect_stdout
from pathlib import Path

from pyml.errors import PymlError
from pyml.package.base import IGNORED_TARGET

# What launchers set to the number of ranks they started: MPICH's and Intel MPI's hydra, Open MPI,
# MVAPICH, and Slurm's srun.
WORLD_SIZE_VARIABLES = (
    "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "SLURM_STEP_NUM_TASKS"
)  # fmt: skip
DEFAULT_PEER_TIMEOUT = 300.0  # seconds: above a checkpoint save or an evaluation on rank 0
ABORT_GRACE = 2.0  # seconds another rank waits before aborting: rank 0, failing alike, speaks first
# seconds between the last line and MPI_Abort: the launcher relays a rank's stderr through a pipe,
# and an abort that comes first can kill the relay before the line is out (seen on a loaded CI)
OUTPUT_DRAIN = 1.0
STATUS_TAG, STATUSES_TAG = 1, 2


def launched_world_size() -> int:
    """How many ranks the launcher that started this process started (1 without one)."""
    for name in WORLD_SIZE_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 1


def share_cores(ranks_here: int) -> None:
    """Give this rank its share of the machine's cores, in each thread pool the user left unset.

    The pools are already loaded when a rank learns how many ranks share its machine (numpy and
    Numba are imported with pyml's kernels), so they are limited through their APIs. Numba must
    not see NUMBA_NUM_THREADS change under it: its compiler re-reads the environment before each
    compilation and raises once its threads run ("Cannot set NUMBA_NUM_THREADS to a different
    value once the threads have been launched"), which a cold cache met on the first compile."""
    threads = max(1, len(os.sched_getaffinity(0)) // ranks_here)
    if "NUMBA_NUM_THREADS" not in os.environ:
        import numba

        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    if "OPENBLAS_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in os.environ:
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads, user_api="blas")  # numpy's and SciPy's OpenBLAS, from now on


class GroupError(PymlError):
    """An error that every rank raises alike, after the ranks agreed on it."""


class PeerSilent(Exception):
    """Another rank sent nothing within the timeout: it died or hangs. Not a PymlError: it is no
    fault of the step in flight, and it ends the job (`MpiWorld.abort`)."""


def describe(error: BaseException) -> str:
    if isinstance(error, PymlError):
        return str(error)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class SingleProcess:
    """Training in one process, exactly as without MPI."""

    is_root = True
    ranks = 1

    def check_batch(self, batch: int) -> None:
        pass

    def optimizer(self, package, model, **options):
        return package.AdamW(model, **options)

    def train_step(self, package, model, optimizer, inputs, targets, stop, slices: int = 1,
                   positions=None) -> float:
        return package.train_step(model, optimizer, inputs, targets, slices, positions=positions)

    def preference_step(self, model, optimizer, batch, objective, stop, slices: int = 1):
        """One optimizer step on a batch of preference pairs (`pyml.train.preference`)."""
        from pyml.train.preference import preference_step

        return preference_step(model, optimizer, batch, objective, slices)

    def save_checkpoint(self, out: Path, model, optimizer, state: dict, model_files=None) -> Path:
        from pyml.train.checkpoint import save_checkpoint

        return save_checkpoint(out, model, optimizer, state, model_files)


class GatheredOptimizer:
    """A sharded optimizer's state gathered on rank 0, as `save_checkpoint` reads an optimizer."""

    def __init__(self, state: dict, step_count: int):
        self._state, self.step_count = state, step_count

    def state(self) -> dict:
        return self._state


class DataParallel:
    """This process as rank `world.rank` of `world.size`, each training on its slice of the batch."""

    def __init__(self, world: MpiWorld, shard_optimizer: bool):
        self.world, self.shard_optimizer = world, shard_optimizer
        self.is_root, self.ranks = world.rank == 0, world.size
        self.exchange = None

    def check_batch(self, batch: int) -> None:
        if batch < self.ranks:  # the same on every rank: each raises it alike
            raise GroupError(
                f"--batch {batch} is smaller than the {self.ranks} ranks: every rank needs at "
                "least one row of each batch"
            )

    def optimizer(self, package, model, **options):
        from pyml.train.gradient_exchange import GradientExchange, ShardedAdamW

        self.exchange = GradientExchange(self.world, model, self.shard_optimizer)
        if self.shard_optimizer:
            return ShardedAdamW(model, self.exchange, **options)
        return package.AdamW(model, **options)

    def train_step(self, package, model, optimizer, inputs, targets, stop, slices: int = 1,
                   positions=None) -> float:
        """One step of the global batch (inputs, targets, and the positions of packed rows), the
        same on every rank, each rank's rows in `slices` slices (`pyml.package.accumulate`);
        returns its loss. Sets `stop.signum` when a stop signal reached any rank (the lowest
        rank's)."""
        import numpy as np

        from pyml.package.accumulate import loss_and_grads

        world, exchange, step = self.world, self.exchange, optimizer.step_count + 1
        world.context = f"at step {step}"
        bounds = [len(inputs) * r // world.size for r in range(world.size + 1)]
        counted = [int(np.count_nonzero(targets[a:b] != IGNORED_TARGET)) for a, b in
                   zip(bounds, bounds[1:])]  # fmt: skip
        total = sum(counted)
        exchange.start_step([count / total if total else 0.0 for count in counted])
        mine = slice(bounds[world.rank], bounds[world.rank + 1])
        failure = None
        try:
            loss = loss_and_grads(model, inputs[mine], targets[mine], slices, exchange.bucket_ready,
                                  None if positions is None else positions[mine])
        except Exception as error:  # bad data or a bug on this rank: every rank drops the step
            loss, failure = math.nan, describe(error)
        exchange.all_buckets_ready()  # those a failure left unreported: the same collectives
        if failure is None and counted[world.rank] and not math.isfinite(loss):
            failure = f"non-finite loss ({loss}) at optimizer step {step}; weights left unchanged"
        statuses = world.allgather_objects((loss, failure, stop.signum), exchange.progress)
        exchange.finish()
        failures = [f"rank {r}: {failed}" for r, (_, failed, _) in enumerate(statuses) if failed]
        if failures:
            raise GroupError("; ".join(failures))
        if not total:
            raise GroupError(
                f"every target of the batch at optimizer step {step} is ignored (-100): the loss "
                "is not defined; weights left unchanged"
            )
        optimizer.step()
        stop.signum = next((signum for _, _, signum in statuses if signum is not None), None)
        # the batch's mean loss: each rank's mean weighted by its counted targets, in rank order
        return sum(count * rank_loss for count, (rank_loss, _, _) in zip(counted, statuses)
                   if count) / total  # fmt: skip

    def preference_step(self, model, optimizer, batch, objective, stop, slices: int = 1):
        """One step of a global batch of preference pairs, the same on every rank: rank r takes
        its share of the pairs, weighted for the whole batch (each pair 1 / its pairs, as TRL
        under DDP), and the ranks' gradients are summed; returns the batch's `PreferenceStep`
        (every rank's pairs, in rank order)."""
        from pyml.train.preference import PreferenceStep, chosen_token_count, preference_loss_and_grads

        world, exchange, step = self.world, self.exchange, optimizer.step_count + 1
        world.context = f"at step {step}"
        bounds = [batch.pairs * r // world.size for r in range(world.size + 1)]
        exchange.start_step([1.0] * world.size)  # each rank's gradient is weighted for the whole batch
        failure, terms = None, []
        try:
            mine = preference_loss_and_grads(
                model, batch.take(slice(bounds[world.rank], bounds[world.rank + 1])), objective, slices,
                exchange.bucket_ready, (batch.pairs, chosen_token_count(batch)))
            loss, terms = mine.loss, mine.terms
        except Exception as error:  # bad data or a bug on this rank: every rank drops the step
            loss, failure = math.nan, describe(error)
        exchange.all_buckets_ready()  # those a failure left unreported: the same collectives
        if failure is None and not math.isfinite(loss):
            failure = f"non-finite loss ({loss}) at optimizer step {step}; weights left unchanged"
        statuses = world.allgather_objects((loss, terms, failure, stop.signum), exchange.progress)
        exchange.finish()
        failures = [f"rank {r}: {failed}" for r, (_, _, failed, _) in enumerate(statuses) if failed]
        if failures:
            raise GroupError("; ".join(failures))
        optimizer.step()
        stop.signum = next((signum for *_, signum in statuses if signum is not None), None)
        return PreferenceStep(sum(rank_loss for rank_loss, *_ in statuses),
                              [term for _, rank_terms, *_ in statuses for term in rank_terms])

    def save_checkpoint(self, out: Path, model, optimizer, state: dict, model_files=None) -> Path:
        """Rank 0 writes the checkpoint (a sharded optimizer's state gathered first, with every
        rank's help); every rank learns whether it was written."""
        from pyml.train.checkpoint import checkpoint_name, save_checkpoint

        world = self.world
        world.context = f"while saving the checkpoint of step {state['step']}"
        if self.shard_optimizer:
            gathered = optimizer.gathered_state()
            optimizer = GatheredOptimizer(gathered, optimizer.step_count) if gathered else None
        failure = None
        if self.is_root:
            try:
                save_checkpoint(out, model, optimizer, state, model_files)
            except PymlError as error:
                failure = str(error)
        (failure, *_) = world.allgather_objects(failure)
        if failure:
            raise GroupError(f"rank 0: {failure}")
        return Path(out) / checkpoint_name(state["step"])


class MpiWorld:
    """The ranks of MPI_COMM_WORLD, and the waiting on them: every wait polls, so that a rank that
    died or hangs ends in an error after `peer_timeout` seconds instead of a hang."""

    def __init__(self, peer_timeout: float):
        import mpi4py

        mpi4py.rc.thread_level = "funneled"  # only the main thread calls MPI
        from mpi4py import MPI

        self.MPI, self.peer_timeout = MPI, peer_timeout
        self.comm = MPI.COMM_WORLD.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.context = "while starting"  # where the ranks are, for the timeout messages
        share_cores(self.comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size())

    def wait_until(self, done, silence: str, timeout: float | None = None, idle=None) -> None:
        """Poll `done()` (and `idle()`, which advances other work) until it is true; raise
        PeerSilent with `silence` once `timeout` (default `peer_timeout`) seconds have passed."""
        timeout = self.peer_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while not done():
            if idle is not None:
                idle()
            if time.monotonic() > deadline:
                raise PeerSilent(f"{silence} within {timeout:g} s: it died or hangs")
            os.sched_yield()  # the peers may need this core

    def wait_for(self, requests, what: str) -> None:
        self.wait_until(
            lambda: self.MPI.Request.Testall(requests),
            f"{what} {self.context} did not complete: a rank sent nothing",
        )

    def allgather_floats(self, values, what: str) -> list[float]:
        import numpy as np

        mine = np.asarray(values, np.float64)
        everyone = np.empty(self.size * len(mine))
        self.wait_for([self.comm.Iallgather(mine, everyone)], what)
        return everyone.tolist()

    def allgather_objects(self, payload, idle=None) -> list:
        """Every rank's `payload`, in rank order, on every rank. Point to point through rank 0, so
        that rank 0 can name a rank that sends nothing."""
        comm = self.comm
        if self.rank != 0:
            request = comm.isend(payload, dest=0, tag=STATUS_TAG)
            # twice the timeout: when another rank is silent, rank 0 names it first
            self.wait_until(lambda: comm.iprobe(source=0, tag=STATUSES_TAG),
                            f"rank 0 sent nothing {self.context}", 2 * self.peer_timeout, idle)  # fmt: skip
            statuses = comm.recv(source=0, tag=STATUSES_TAG)
            request.wait()
            return statuses
        received = {0: payload}

        def all_received() -> bool:
            for rank in range(1, self.size):
                if rank not in received and comm.iprobe(source=rank, tag=STATUS_TAG):
                    received[rank] = comm.recv(source=rank, tag=STATUS_TAG)
            return len(received) == self.size

        try:
            self.wait_until(all_received, "", idle=idle)
        except PeerSilent:
            silent = ", ".join(str(r) for r in range(self.size) if r not in received)
            raise PeerSilent(
                f"rank {silent} sent nothing {self.context} within {self.peer_timeout:g} s: "
                "it died or hangs"
            ) from None
        statuses = [received[rank] for rank in range(self.size)]
        self.MPI.Request.waitall(
            [comm.isend(statuses, dest=rank, tag=STATUSES_TAG) for rank in range(1, self.size)]
        )
        return statuses

    def abort(self, error: BaseException) -> None:
        """End every rank of the job after one line about `error`, raised on this rank alone."""
        if self.rank != 0:
            time.sleep(ABORT_GRACE)
        if isinstance(error, PeerSilent):
            line = f"error: {error}; stopping every rank"
        else:
            if not isinstance(error, (PymlError, KeyboardInterrupt)):
                traceback.print_exception(error)  # a bug: its traceback, then the line
            line = f"error: rank {self.rank}: {describe(error)}; stopping every rank"
        print(line, file=sys.stderr, flush=True)
        time.sleep(OUTPUT_DRAIN)
        self.MPI.COMM_WORLD.Abort(2)  # MPICH adds a line of its own: "Abort(2) on node ..."


@contextmanager
def process_group(shard_optimizer: bool = False, peer_timeout: float | None = None):
    """This process's part in training: `SingleProcess`, or a rank of `DataParallel` when a launcher
    started several. On a rank, an error agreed by all (GroupError) is printed once, by rank 0, and
    every rank exits with status 2; any other error ends the whole job (`MpiWorld.abort`)."""
    if launched_world_size() == 1:
        yield SingleProcess()
        return
    if importlib.util.find_spec("mpi4py") is None:
        raise PymlError(
            f"this process is one of {launched_world_size()} ranks, but mpi4py is not installed: "
            "pip install mpi4py (built against the MPI that launched it)"
        )
    world = MpiWorld(peer_timeout or DEFAULT_PEER_TIMEOUT)
    try:
        with ExitStack() as stack:
            if world.rank != 0:  # logs and the summary come from rank 0 alone
                stack.enter_context(redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
            yield DataParallel(world, shard_optimizer)
    except GroupError:
        if world.rank == 0:
            raise
        raise SystemExit(2) from None
    except (Exception, KeyboardInterrupt) as error:
        world.abort(error)
        # MPI_Abort does not return where MPI honours it; where it did (a busy machine), the error
        # was swallowed here and the command failed on its missing result instead
        raise SystemExit(2) from None


def launch(ranks: int, arguments: list[str]) -> None:
    """Replace this process with `mpiexec -n RANKS python -m pyml.cli ARGUMENTS` (the command line
    of `pyml`, less its --ranks), so that Ctrl-C and SIGTERM reach mpiexec, which forwards them to
    every rank."""
    if launched_world_size() > 1:
        raise PymlError("--ranks starts its own mpiexec: leave it out under mpiexec or srun")
    if importlib.util.find_spec("mpi4py") is None:
        raise PymlError("--ranks needs mpi4py and an MPI: pip install mpi4py mpich")
    beside_python = Path(sys.executable).parent / "mpiexec"  # the mpich wheel's, in a venv
    mpiexec = str(beside_python) if beside_python.exists() else shutil.which("mpiexec")
    if mpiexec is None:
        raise PymlError("--ranks needs mpiexec: pip install mpich, or load your site's MPI")
    sys.stdout.flush()
    sys.stderr.flush()
    command = [mpiexec, "-n", str(ranks), sys.executable, "-m", "pyml.cli"]
    os.execv(mpiexec, command + without_option(arguments, "--ranks"))


def without_option(arguments: list[str], name: str) -> list[str]:
    """`arguments` without `name VALUE` or `name=VALUE`."""
    kept, skip = [], False
    for argument in arguments:
        if skip:
            skip = False
        elif argument == name:
            skip = True
        elif not argument.startswith(f"{name}="):
            kept.append(argument)
    return kept
