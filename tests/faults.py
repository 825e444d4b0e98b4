"""Fault injection for the trainers: run a trainer in a subprocess that SIGKILLs itself at a chosen moment.

    python -m tests.faults POINT NTH -- -m vision.train --config ... key=value ...

``POINT`` names where the process dies, ``NTH`` at which occurrence (1 = the first):

* ``ckpt_write``  -- inside a checkpoint write, after half of the temporary file is on disk;
* ``ckpt_done``   -- right after a checkpoint file got its final name (before retention and ema.safetensors);
* ``weights``     -- inside a ``save_weights`` (ema.safetensors at a checkpoint, or the final weights);
* ``step``        -- in the middle of an optimizer step (after the backward pass, before the update);
* ``final``       -- after the final checkpoint, before the final outputs.

Other faults at the same seams (the process does not kill itself):

* ``sigterm_at_shutdown`` -- a real SIGTERM to itself while the finished run releases its directory, and another
  right after it handed its stop signals back: a scheduler's signal that arrives while a finished run shuts down;
* ``sigterm``     -- a real SIGTERM to itself at the nth optimizer step, as a scheduler preempts a job (only in a
  process whose command line contains ``$FAULT_ARGV`` when that is set: one job of a study);
* ``sigterm_output`` -- a real SIGTERM to itself after it wrote its nth output of a round (a ``diffusion.sample``
  chunk, a ``diffusion.extract_latents`` shard; only on rank ``$FAULT_RANK`` when that is set: one process of several);
* ``bug``         -- a plain ``ValueError`` (a bug, not bad input) raised in an optimizer step;
* ``rank1_input`` -- an input error that only rank 1 meets, while building the run.

The trainer's own code runs unchanged; only these library-level seams are wrapped. Used by tests/test_faults.py
and by scripts/fault_suite.py (many random kill points).
"""
from __future__ import annotations

import os
import runpy
import signal
import sys

POINTS = ("ckpt_write", "ckpt_done", "weights", "step", "final")  # kill points
OTHER_FAULTS = ("sigterm_at_shutdown", "sigterm", "sigterm_output", "bug", "rank1_input")


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def install(point: str, nth: int) -> None:
    from common import checkpoint, preemption, train_state, trainer

    seen = [0]

    def hit() -> bool:
        seen[0] += 1
        return seen[0] == nth

    def die_on_call(owner, name: str):
        """Replace ``owner.name`` by a wrapper that dies on the nth call, before doing anything."""
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if hit():
                die()
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)
        return wrapper

    if point == "ckpt_write":
        original_save = train_state.torch.save

        def torn_save(obj, f, *args, **kwargs):
            if hit():
                import io

                buffer = io.BytesIO()
                original_save(obj, buffer, *args, **kwargs)
                with open(f, "wb") if isinstance(f, (str, os.PathLike)) else f as out:  # a path or an open file
                    out.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
                    out.flush()
                    os.fsync(out.fileno())
                die()
            return original_save(obj, f, *args, **kwargs)

        train_state.torch.save = torn_save
    elif point == "ckpt_done":
        die_on_call(train_state.CheckpointManager, "prune")
    elif point == "weights":
        trainer.save_weights = die_on_call(checkpoint, "save_weights")
    elif point == "step":
        original_step = trainer.Trainer.train_step

        def train_step(self, batches):
            if hit():
                original_backward = self.accelerator.backward

                def backward_then_die(loss, **kwargs):
                    original_backward(loss, **kwargs)
                    die()

                self.accelerator.backward = backward_then_die
            return original_step(self, batches)

        trainer.Trainer.train_step = train_step
    elif point == "final":
        die_on_call(trainer.Trainer, "_finish")
    elif point == "sigterm_at_shutdown":
        original_release, original_restore = train_state.RunLock.release, preemption.StopRequests.restore

        def release_after_signal(self):  # mid-shutdown: the run is finished, its directory still locked
            os.kill(os.getpid(), signal.SIGTERM)  # delivered at once, to whatever handler is in place
            return original_release(self)

        def restore_then_signal(self):  # the run handed its stop signals back
            original_restore(self)
            os.kill(os.getpid(), signal.SIGTERM)

        train_state.RunLock.release = release_after_signal
        preemption.StopRequests.restore = restore_then_signal
    elif point == "sigterm":
        original_step = trainer.Trainer.train_step

        def train_step_then_signal(self, batches):
            result = original_step(self, batches)
            if os.environ.get("FAULT_ARGV", "") in " ".join(sys.argv) and hit():
                os.kill(os.getpid(), signal.SIGTERM)  # recorded by the trainer's handler, answered at this step's end
            return result

        trainer.Trainer.train_step = train_step_then_signal
    elif point == "sigterm_output":
        from diffusion import latents
        from diffusion.sampling import sample_sets

        def then_signal(write):
            def wrapper(*args, **kwargs):
                result = write(*args, **kwargs)
                rank = os.environ.get("RANK", "0")
                if os.environ.get("FAULT_RANK", rank) == rank and hit():
                    os.kill(os.getpid(), signal.SIGTERM)
                return result

            return wrapper

        sample_sets.atomic_savez = then_signal(sample_sets.atomic_savez)
        latents.write_shard = then_signal(latents.write_shard)  # before extract_latents imports it
    elif point == "bug":
        original_step = trainer.Trainer.train_step

        def buggy_step(self, batches):
            if hit():
                raise ValueError("a bug in project code (tests/faults.py)")
            return original_step(self, batches)

        trainer.Trainer.train_step = buggy_step
    elif point == "rank1_input":
        from common.cli import InputError

        original_build = trainer.Trainer._build

        def build(self):
            if self.rank == 1 and hit():
                raise InputError("only rank 1 meets this input error (tests/faults.py); fix it there")
            return original_build(self)

        trainer.Trainer._build = build
    else:
        raise SystemExit(f"unknown fault point {point!r}; choose one of {', '.join(POINTS + OTHER_FAULTS)}")


if __name__ == "__main__":
    point, nth, separator, flag, module, *args = sys.argv[1:]
    assert separator == "--" and flag == "-m", "usage: python -m tests.faults POINT NTH -- -m MODULE ARGS..."
    install(point, int(nth))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
