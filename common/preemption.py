"""Stopping a run cleanly where clusters stop jobs: a signal before the kill, a time limit, a rank that dies.

    stop = StopRequests(STOP_SIGNALS, ckpt_every_minutes=30)
    stop.install()
    ...
    after each optimizer step:  signal, checkpoint_due = stop.agree(step)    # the same answer on every rank

SLURM (``--signal``), Kubernetes and spot instances send SIGTERM (or a chosen signal) some seconds before the
kill. The handler only records the signal: the loop asks at a step boundary, every rank the same question at the
same step, and the ranks agree through one small all-reduce (on a CPU process group, so a GPU is never waited
for). The run then writes one consistent checkpoint and exits with :data:`EXIT_PREEMPTED`, which a job script
requeues on. Nothing is written inside the handler.

The handlers stay installed until the run's process group is gone. A command line
(:func:`ignore_stop_signals_at_exit`) then ignores the signals instead of restoring the old handlers, so a
signal that arrives while a finished run shuts down changes nothing: the process exits 0, not 143 (which a job
script reads as a failure).
"""
from __future__ import annotations

import contextlib
import signal
import time
from typing import Iterator, Optional, Sequence, Tuple

import torch

from common.cli import InputError, process_rank

STOP_SIGNALS = ("SIGTERM", "SIGUSR1")  # what SLURM, Kubernetes and spot instances send (``train.stop_signals``)

EXIT_PAUSED = 3  # the run stopped at train.stop_at_step: incomplete, continue it with the same command
EXIT_PREEMPTED = 4  # a stop signal arrived: a checkpoint of this step was written; requeue the same command
_IGNORE_AT_EXIT = False


def ignore_stop_signals_at_exit() -> None:
    """For a command line whose process ends with its run: when a run hands its stop signals back
    (:meth:`StopRequests.restore`), they are ignored from then on instead of getting their old handlers back."""
    global _IGNORE_AT_EXIT
    _IGNORE_AT_EXIT = True


def signal_number(name: str) -> int:
    try:
        return int(getattr(signal, name))
    except AttributeError:
        raise InputError(f"unknown signal {name!r}; e.g. SIGTERM, SIGUSR1, SIGUSR2, SIGINT") from None


class StopRequests:
    """The stop signals received and the time-based checkpoint cadence, agreed over all ranks at step boundaries.

    Args:
        signals: names of the signals that request a stop (``train.stop_signals``).
        ckpt_every_minutes: also ask for a checkpoint when this long passed since the last one (rank 0's clock).
        check_every: ask every this many steps (the all-reduce costs a CPU round trip between processes).
        group: the process group to agree over (a gloo group; None: the default one, or no agreement with one
            process).
    """

    def __init__(self, signals: Sequence[str] = STOP_SIGNALS, ckpt_every_minutes: Optional[float] = None,
                 check_every: int = 1, group=None, world: int = 1, rank: int = 0):
        self.signals = [signal_number(s) for s in signals]
        self.ckpt_every_s = None if ckpt_every_minutes is None else 60.0 * ckpt_every_minutes
        self.check_every, self.group, self.world, self.rank = check_every, group, world, rank
        self.received: Optional[int] = None
        self.last_checkpoint = time.monotonic()
        self._previous = {}

    def install(self) -> "StopRequests":
        """Record the signals from now on. A signal an enclosing :class:`StopRequests` (a comparison that runs runs in
        turn) has received is taken over: this run stops at its first step."""
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._record)
            outer = getattr(self._previous[number], "__self__", None)
            if isinstance(outer, StopRequests) and outer.received == number:
                self.received = number
        return self

    def restore(self, pass_on: bool = True) -> None:
        """The handlers from before :meth:`install`; ``SIG_IGN`` after :func:`ignore_stop_signals_at_exit`.

        A stop signal this run received is passed on to the handler from before when that is a Python function: a
        process that runs several runs in turn (``scripts.compare``) learns of it and starts no further run, also
        when the signal came after this run's last step, where the run itself ignores it. ``pass_on=False``: the
        signal was acted on here (a command that ends on it), so Python's own SIGINT handler raises nothing."""
        previous = self._previous.get(self.received) if self.received and pass_on else None
        for number, handler in self._previous.items():
            signal.signal(number, signal.SIG_IGN if _IGNORE_AT_EXIT else handler)
        self._previous.clear()
        if callable(previous) and not _IGNORE_AT_EXIT:
            previous(self.received, None)

    def _record(self, number, frame) -> None:
        self.received = number  # only this: the loop acts at its next step boundary

    def checkpoint_written(self) -> None:
        self.last_checkpoint = time.monotonic()

    def agree(self, step: int) -> Tuple[Optional[str], bool]:
        """``(name of a stop signal some rank received, or None; a time-based checkpoint is due)``, the same on every
        rank. Between check steps: ``(None, False)`` without communication."""
        if step % self.check_every:
            return None, False
        due = self.ckpt_every_s is not None and self.rank == 0 and time.monotonic() - self.last_checkpoint >= self.ckpt_every_s
        flags = torch.tensor([self.received or 0, int(due)], dtype=torch.int64)
        if self.world > 1:
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self.group)
        number, due = (int(v) for v in flags)
        return (signal.Signals(number).name if number else None), bool(due)


class WorkStopped(Exception):
    """A stop signal ended a command that works in rounds (sample chunks, latent shards) between two rounds: what
    the finished rounds wrote stays, and the same command continues."""

    def __init__(self, signal_name: str, done: int, rounds: int, unit: str):
        super().__init__(f"{signal_name} received: stopped after {done} of {rounds} rounds of {unit}; the {unit} "
                         f"written stay: run the same command to continue (exit {EXIT_PREEMPTED})")


def stoppable_rounds(rounds: int, signals: Sequence[str], world: int = 1, rank: int = 0,
                     unit: str = "work") -> Iterator[int]:
    """``0 .. rounds - 1``: the rounds of a command in which each process does one unit of work per round. With
    ``signals`` (:func:`command_stop_signals`), the processes agree after every round, over a gloo group, whether
    one received a stop signal; if so all raise :class:`WorkStopped` before the next round. A signal during the last
    round changes nothing."""
    from common.distributed import cpu_group

    stop = StopRequests(signals, group=cpu_group(world) if signals else None, world=world, rank=rank).install()
    try:
        for round_ in range(rounds):
            yield round_
            if signals:
                signalled, _ = stop.agree(round_)
                if signalled and round_ < rounds - 1:
                    raise WorkStopped(signalled, round_ + 1, rounds, unit)
    finally:
        stop.restore()


def command_stop_signals(argv) -> Tuple[str, ...]:
    """The stop signals a command that works in rounds acts on: :data:`STOP_SIGNALS` when ``argv`` is None (the
    process's own command line, which from then on ignores a signal that comes once its work is done), none for a
    caller in the same process (``scripts.compare``, tests), whose own handling stays."""
    if argv is not None:
        return ()
    ignore_stop_signals_at_exit()
    return tuple(STOP_SIGNALS)


@contextlib.contextmanager
def exit_when_stopped():
    """A :class:`WorkStopped` inside ends the process with :data:`EXIT_PREEMPTED`, which a job script requeues on;
    rank 0 prints why."""
    try:
        yield
    except WorkStopped as stopped:
        if process_rank() == 0:
            print(stopped, flush=True)
        raise SystemExit(EXIT_PREEMPTED) from None
