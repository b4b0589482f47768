"""Ranks, the collective device, and :func:`agree`: how every rank learns that some rank failed.

A check that runs on one rank (a bad batch, a NaN loss, a file that cannot be read or written)
must not leave the other ranks waiting in the next collective until the timeout, nor let them
fail with a bare "Connection closed by peer". :func:`agree` makes any local verdict collective:
every rank calls it at the same point with its own error (or None), and if any rank has one,
every rank raises the same error type, naming the failing ranks and their messages. When no rank
failed it costs one ``all_reduce`` of ``slots x world_size`` small integers.

Everything here uses the default process group and is a no-op (or a local decision) without an
initialised group of more than one rank. :func:`init_elastic_group` and :func:`shutdown_at_exit`
set that group up and take it down under ``torchrun``.
"""

from __future__ import annotations

import atexit
import gc
import os
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lightning_torchrec.compat.elastic import warn_multi_agent_restarts
from lightning_torchrec.errors import PeerFailureError, RankFailureError
from lightning_torchrec.failure_reports import explain

T = TypeVar("T")

#: The key prefix of one torchrun attempt's process groups in the agent's store.
ATTEMPT_PREFIX = "lightning_torchrec/attempt_{}"


def attempt_store(timeout: timedelta) -> dist.Store | None:
    """The store a process group of this torchrun attempt must use, or None outside torchrun.

    With ``--rdzv-backend c10d`` (torch 2.4+), workers build their process groups in the agent's
    own TCPStore (``TORCHELASTIC_USE_AGENT_STORE=True``), which outlives the workers: after a
    restart, the new attempt finds the dead attempt's keys (each rank's gloo address, the
    barrier counters) under the same names and may read them before they are rewritten, then
    connects to a dead peer ("Gloo connectFullMesh failed ... Connection refused") or hangs.
    This store puts every key of attempt ``TORCHELASTIC_RESTART_COUNT`` under its own prefix
    (:data:`ATTEMPT_PREFIX`); the agents of a multi-node job do not share that count (a warning
    says so, :mod:`lightning_torchrec.compat.elastic`).

    Args:
        timeout: how long a rank waits for a key.

    Returns:
        A ``PrefixStore`` over a client of the agent's store; None when the workers do not
        share the agent's store (no torchrun, another rendezvous, or
        ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    warn_multi_agent_restarts()
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timeout,
    )
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    return dist.PrefixStore(ATTEMPT_PREFIX.format(attempt), agent)


def init_elastic_group(
    backend: str, rank: int, world_size: int, timeout: timedelta, device: torch.device | None
) -> bool:
    """Initialises the default process group in :func:`attempt_store`, under torchrun.

    Args:
        backend: ``"gloo"``, ``"nccl"``, ...
        rank: this process's global rank.
        world_size: the number of processes.
        timeout: the collective timeout.
        device: the rank's accelerator (bound to the group), or None on the CPU.

    Returns:
        True when it initialised the group; False when a group is up already or the workers do
        not share the agent's store (the caller initialises as usual).
    """
    if dist.is_initialized():
        return False
    store = attempt_store(timeout)
    if store is None:
        return False
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=timeout, device_id=device
    )
    return True


def shutdown() -> None:
    """Destroys every process group, and joins their threads before the interpreter finalises.

    ``destroy_process_group`` only unregisters them: gloo's threads and the ``TCPStore``'s
    server (rank 0) lived on in reference cycles, for the finalising interpreter, where a thread
    taking the GIL inside C++ aborts ("terminate called without an active exception").
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # the groups and stores nothing holds: destroyed now, their threads joined
    time.sleep(0.01)  # a thread waiting for the GIL (gloo's, freeing tensors) has it now


def shutdown_at_exit() -> None:
    """Makes :func:`shutdown` run at the interpreter's exit (once, however often it is called)."""
    atexit.unregister(shutdown)
    atexit.register(shutdown)


def is_distributed() -> bool:
    """Whether a default process group of more than one rank is up.

    Returns:
        True when collectives reach other ranks.
    """
    return rank_and_world_size()[1] > 1


def rank_and_world_size() -> tuple[int, int]:
    """This process's rank and the world size.

    Returns:
        ``(rank, world_size)``; ``(0, 1)`` when ``torch.distributed`` is not initialised.
    """
    # The default group's own rank and size: what ``dist.get_rank()`` and
    # ``dist.get_world_size()`` return for it, without their dozen Python calls (every step).
    group = dist.GroupMember.WORLD if dist.is_available() else None
    return (0, 1) if group is None else (group.rank(), group.size())


def _vote_place(group: Any, device: torch.device | None) -> torch.device:
    """Where the votes of a collective over ``group`` live: the CPU for a gloo group."""
    if group is not None and dist.get_backend(group) == "gloo":
        return torch.device("cpu")
    return device or collective_device()


def collective_device() -> torch.device:
    """The device that tensors given to collectives of the default group must live on.

    Returns:
        The current CUDA device when the default backend is NCCL, else the CPU.
    """
    nccl = dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend())
    if nccl and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_from_rank0(fn: Callable[[], T]) -> T:
    """Runs ``fn`` on rank 0 only and gives its result (picklable) to every rank.

    An exception in ``fn`` is raised on every rank (see :func:`agree`), not left on rank 0 while
    the others wait for the broadcast.

    Args:
        fn: the computation.

    Returns:
        Rank 0's result, on every rank.
    """
    if not is_distributed():
        return fn()
    result: Any = None
    error: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - raised on every rank by agree()
            error = e
    agree(error)
    box = [result]
    run_collective(dist.broadcast_object_list, box, src=0)
    return box[0]


def all_gather(value: T, group: Any = None) -> list[T]:
    """Every rank's ``value`` (picklable), in rank order. Collective.

    Args:
        value: this rank's value.
        group: the process group over every rank (default: the default group).

    Returns:
        ``[value of rank 0, value of rank 1, ...]``; ``[value]`` without a process group.
    """
    if not is_distributed():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    run_collective(dist.all_gather_object, values, value, group=group)  # a dead peer: named
    return values


def ranks_where(flag: bool, device: torch.device | None = None, group: Any = None) -> list[int]:
    """Which ranks pass ``flag=True``; collective (one ``all_reduce`` of ``world_size`` ints).

    Args:
        flag: this rank's vote.
        device: where the votes live (default: :func:`collective_device`; the CPU for a gloo
            ``group``).
        group: the process group over every rank (default: the default group).

    Returns:
        The ranks that voted True, the same list on every rank.
    """
    return _launch_votes([flag], device, group, later=False)()[0]


def _launch_votes(
    flags: list[bool], device: torch.device | None, group: Any = None, later: bool = True
) -> Callable[[], list[list[int]]]:
    """Runs the votes' ``all_reduce`` (``later``: started only); returns what reads them."""
    rank, world = rank_and_world_size()
    if world == 1:
        return lambda: [[0] if f else [] for f in flags]
    device = _vote_place(group, device)
    cells = [0] * (len(flags) * world)  # built on the host: one tensor, no indexed write
    for i, flag in enumerate(flags):
        cells[i * world + rank] = int(flag)
    votes = torch.tensor(cells, dtype=torch.int32, device=device).view(len(flags), world)
    work = dist.all_reduce(votes, group=group, async_op=later)

    def read() -> list[list[int]]:
        if later:
            work.wait()
        return [[r for r, v in enumerate(row) if v] for row in votes.tolist()]

    return read


def _rebuild(kind: type[BaseException], text: str) -> BaseException:
    try:
        error = kind(text)
    except Exception:  # noqa: BLE001 - an error type that takes other arguments
        return RankFailureError(text)
    return error if isinstance(error, Exception) else RankFailureError(text)


def agree(
    *errors: BaseException | None,
    flags: Sequence[bool] = (),
    device: torch.device | None = None,
    group: Any = None,
) -> list[list[int]]:
    """Raises on every rank if any rank passes an error. Collective: call it on every rank.

    Each positional argument is a *slot* (e.g. "this step's batch" and "the previous step's
    loss"); all slots, and any boolean ``flags`` riding along, are decided in one
    ``all_reduce``. The first slot in which some rank failed is raised: the ranks' messages are
    gathered (only then, so the common case costs one tiny collective), the failing rank
    re-raises its own error (chained, with the other failing ranks' messages when there are
    several), and every other rank raises an error of the same type saying
    ``"stopped because another rank failed: rank R: <message>"``.

    Args:
        *errors: this rank's verdict per slot: an exception, or None when this rank is fine.
        flags: further votes to count in the same collective (e.g. "this is my last batch").
        device: where the votes live (default: :func:`collective_device`).
        group: the process group over every rank to vote on (default: the default group). A
            gloo group over the same ranks (``dist.new_group(backend="gloo")``, owned by whoever
            made it) keeps the votes on the host: deciding them never synchronises a GPU.

    Returns:
        For each flag, the ranks that voted True (the same on every rank).

    Raises:
        BaseException: the agreed error, on every rank, when any rank failed in some slot.
    """
    return launch_agree(*errors, flags=flags, device=device, group=group, later=False)()


def launch_agree(
    *errors: BaseException | None,
    flags: Sequence[bool] = (),
    device: torch.device | None = None,
    group: Any = None,
    later: bool = True,
) -> Callable[[], list[list[int]]]:
    """:func:`agree`, started now and decided later: the vote runs while this rank works on.

    The returned function waits for the vote and does what :func:`agree` does with it (raises
    the agreed error, or returns the flags). Every rank must call it at the same point of its
    program, and before any other collective on ``group``: what runs in between must not
    depend on the outcome.

    Args:
        *errors: this rank's verdict per slot (see :func:`agree`).
        flags: further votes to count in the same collective.
        device: where the votes live.
        group: the process group to vote on.
        later: False runs the collective now (the returned function then only reads it).

    Returns:
        A function that decides the vote: it returns each flag's ranks, or raises.
    """
    if not is_distributed():

        def decide_alone() -> list[list[int]]:
            for error in errors:
                if error is not None:
                    raise error
            return [[0] if f else [] for f in flags]

        return decide_alone
    read = _launch_votes([e is not None for e in errors] + list(flags), device, group, later)

    def decide() -> list[list[int]]:
        votes = read()
        failing, flagged = votes[: len(errors)], votes[len(errors) :]
        slot = next((i for i, ranks in enumerate(failing) if ranks), None)
        if slot is None:
            return flagged
        _raise_agreed(errors[slot], group)
        return flagged  # not reached

    return decide


def _raise_agreed(mine: BaseException | None, group: Any) -> None:
    """Raises the slot's agreed error (after gathering the failing ranks' messages)."""
    report = None if mine is None else (type(mine), str(mine))
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report, group=group)
    found = [(r, rep) for r, rep in enumerate(reports) if rep is not None]
    text = "; ".join(f"rank {r}: {message}" for r, (_, message) in found)
    if mine is not None:
        if len(found) == 1:
            raise mine
        raise _rebuild(type(mine), f"several ranks failed: {text}") from mine
    raise _rebuild(found[0][1][0], f"stopped because another rank failed: {text}")


_PEER_SIGNS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "socket closed",
    "connection refused",
)


def peer_failure(exc: BaseException, timeout: Any = None) -> PeerFailureError | None:
    """A :class:`PeerFailureError` explaining ``exc`` if it is a failed collective, else None.

    Args:
        exc: the exception raised inside a step.
        timeout: the collective timeout, for the message.

    Returns:
        The explaining error, or None for unrelated exceptions.
    """
    # torch's own errors, or gloo's (plain RuntimeErrors naming a gloo source file); a user's
    # RuntimeError that merely says "timed out" (a DataLoader's) is this rank's own error.
    text = str(exc).lower()
    gloo = isinstance(exc, RuntimeError) and ("gloo" in text or "pair closure" in text)
    if not (isinstance(exc, dist.DistError) or (gloo and any(s in text for s in _PEER_SIGNS))):
        return None
    seen = str(exc).splitlines()[0][:300]
    failure = PeerFailureError(
        "a collective failed: another rank probably died (killed, out of memory) or stopped "
        f"answering within the collective timeout ({timeout}). Check the other ranks' logs; "
        f"resume from the last checkpoint. Original error: {seen}"
    )
    return explain(failure, seen)  # the failing rank's own error, when it reported one


def run_collective(fn: Any, *args: Any, timeout: Any = None, **kwargs: Any) -> Any:
    """Runs ``fn`` (which enters collectives); a peer that died raises :class:`PeerFailureError`.

    Errors that are already the package's agreed errors pass through unchanged.

    Args:
        fn: the call.
        *args: its positional arguments.
        timeout: the collective timeout, for the message.
        **kwargs: its keyword arguments.

    Returns:
        What ``fn`` returned.

    Raises:
        PeerFailureError: when ``fn`` failed because a peer died or timed out.
    """
    try:
        return fn(*args, **kwargs)
    except (PeerFailureError, RankFailureError):
        raise
    except RuntimeError as err:
        failure = peer_failure(err, timeout)
        if failure is None:
            raise
        raise failure from err
