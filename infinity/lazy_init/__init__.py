"""``infinity.init``: build models larger than RAM without ever holding them.

    with infinity.init(config):
        model = build_model()          # parameters on the meta device: no storage
    model, opt = infinity.initialize(model, config)   # each unit materialised on its own

Under the context every module is created on the meta device, and a
``TorchFunctionMode`` records, in program order, each operation that creates
a tensor or writes into one (``torch.empty``, ``nn.init.normal_``,
``Tensor.uniform_``, ``mul_``, ...). ``initialize`` later replays that tape
(see [Note: replaying the tape]) on the CPU, from the global RNG state the
program had when it entered the context, and hands each paging unit's final
values to the engine as soon as the last operation writing them has run, so
only the units in progress (plus, while a discarded random draw runs, a
scratch tensor of its size: see [Note: the replay's scratch is not kept] in
replay.py) are ever in RAM.

[Note: reproducibility]
Eager construction draws every random number from torch's one global CPU
generator, in construction order, including draws that a later
re-initialisation throws away (``nn.Linear.__init__`` draws a Kaiming uniform
that ``GPT._init`` then overwrites). The replay runs every random operation
in the same order on a tensor of the same size and strides, so it consumes
the same numbers: a model built under ``infinity.init`` after
``torch.manual_seed(s)`` holds bit-for-bit the parameters of the model built
eagerly after ``torch.manual_seed(s)``. On leaving the context the global
generator is advanced exactly as eager construction would have left it (a
"dry" replay of the random operations alone, into scratch), so whatever the
program draws afterwards (data order, dropout) is the same too; ``initialize``
restores the generator after its own replay. ``torch.manual_seed`` or
``torch.set_rng_state`` called inside the context are honoured (a change of
the generator's state between two recorded operations is replayed as such);
``torch.get_rng_state`` (and so ``torch.random.fork_rng``) is refused there,
since it would read a state that no initialisation has advanced yet.

Config.seed: ``init`` does not reseed on its own. torch seeds its generator
at random at start-up, so "the program never seeded" cannot be told apart
from a deliberate seed, and seeding from ``Config.seed`` unconditionally would
override the program's own ``torch.manual_seed``. Pass
``infinity.init(config, seed=config.seed)`` (or call ``torch.manual_seed``)
to make the build reproducible from the config.

Refused (a ``NotImplementedError`` naming the operation and the tensor):
explicit ``generator=`` arguments, random operations whose draws depend on
tensor values (``multinomial``, ``poisson``), random operations producing
real (non-meta) tensors inside the context (they would run now, out of
order), other unknown random-looking operations, ``set_``/``resize_`` of a
recorded tensor. A parameter whose value comes from ``torch.empty`` that
nothing overwrote is zero-filled with a warning (eager construction would
leave uninitialised memory there).

Owns: the tape of creation ops and its replay. May import: config/ only.
"""

from __future__ import annotations

# Layout: ops.py (what is recordable), tape.py (the recording), replay.py
# (running the tape), materialize.py (into paging units), recorder.py (the
# Recorder and the model -> recorder registry), context.py (``init``).
from .context import init
from .recorder import Recorder, recorder_of

__all__ = ["init", "Recorder", "recorder_of"]
