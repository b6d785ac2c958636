"""``infinity.init``, the user-facing context: puts module construction on
the meta device and routes every tensor operation to the recorder."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.init as nn_init
from torch.overrides import TorchFunctionMode

from .ops import PATCHED_INIT
from .recorder import Recorder

_ACTIVE = threading.local()


class _Mode(TorchFunctionMode):
    """Runs each operation (on meta tensors under the context) and shows it to the recorder."""

    def __init__(self, rec: Recorder):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.rec.observe(func, args, kwargs, out)
        return out


@contextlib.contextmanager
def init(config: Any = None, *, seed: Optional[int] = None, advance_rng: bool = True) -> Iterator[Recorder]:
    """Builds the models constructed inside it without storage; see the
    :mod:`infinity.lazy_init` docstring.

    Args:
        config: the ``infinity.Config`` the model will be initialised with
            (kept for symmetry with ``initialize``; ``Config.seed`` is not
            applied implicitly, see the module docstring).
        seed: if given, ``torch.manual_seed(seed)`` on entry.
        advance_rng: leave the global generator where eager construction
            would (costs one replay of the random draws, about the time eager
            initialisation spends drawing). ``False`` leaves it where it was
            on entry.

    Yields the :class:`Recorder`. Contexts do not nest.
    """
    _check_can_open(config)
    if seed is not None:
        torch.manual_seed(seed)
    rec = Recorder()
    rec.rng_start = rec.rng_seen = torch.default_generator.get_state()
    with _recording_into(rec):
        with torch.device("meta"), _Mode(rec):
            yield rec
        rec.note_rng()
    if advance_rng:
        rec.advance_rng()


def _check_can_open(config: Any) -> None:
    from ..config.runtime import Config
    if config is not None and not isinstance(config, Config):
        raise TypeError(f"infinity.init: config must be an infinity.Config or None, got {type(config).__name__}")
    if getattr(_ACTIVE, "rec", None) is not None:
        raise RuntimeError("infinity.init: contexts do not nest")
    if not hasattr(torch.utils, "swap_tensors"):
        raise RuntimeError(f"infinity.init needs torch >= 2.3 (torch.utils.swap_tensors); this is {torch.__version__}")


@contextlib.contextmanager
def _recording_into(rec: Recorder) -> Iterator[None]:
    """Installs, for the context's duration, what the mode alone does not
    see: module registrations (for names and buffers), the nn.init functions
    that skip meta tensors, and the refusal of ``torch.get_rng_state``."""
    from torch.nn.modules import module as _m
    handles = [
        _m.register_module_parameter_registration_hook(lambda m, n, v: rec.note_module(m, n, v)),
        _m.register_module_buffer_registration_hook(lambda m, n, v: rec.note_module(m, n, v)),
        _m.register_module_module_registration_hook(lambda m, n, v: rec.note_module(m, n, v)),
    ]
    originals = {name: getattr(nn_init, name) for name in PATCHED_INIT}
    for name, fn in originals.items():
        setattr(nn_init, name, _recording(rec, fn))
    get_state = torch.get_rng_state
    torch.get_rng_state = torch.random.get_rng_state = _refuse_get_rng_state
    hf_restore = _hf_init_on_meta()
    _ACTIVE.rec = rec
    try:
        yield
    finally:
        _ACTIVE.rec = None
        hf_restore()
        torch.get_rng_state = torch.random.get_rng_state = get_state
        for name, fn in originals.items():
            setattr(nn_init, name, fn)
        for h in handles:
            h.remove()


def _hf_init_on_meta() -> Callable[[], None]:
    """Hugging Face models skip their own ``_init_weights`` when built on
    the meta device (``PreTrainedModel.init_weights`` checks the default
    device), which would leave every tensor at torch's module defaults
    instead of the model's initialisation. For the context's duration
    ``init_weights`` runs it (the draws are recorded and replayed like any
    other), at the same point of construction as an eager build. Returns
    the function that restores the original. Only when transformers is
    already imported: the context never imports it."""
    import sys
    mu = sys.modules.get("transformers.modeling_utils")
    cls = getattr(mu, "PreTrainedModel", None)
    if cls is None or not hasattr(cls, "initialize_weights"):
        return lambda: None
    original = cls.__dict__["init_weights"]

    def init_weights(self):
        self.initialize_weights()
        self.tie_weights(recompute_mapping=False)

    init_weights.__wrapped__ = original  # type: ignore[attr-defined]
    cls.init_weights = init_weights

    def restore() -> None:
        cls.init_weights = original

    return restore


def _refuse_get_rng_state() -> torch.Tensor:
    # Under the context nothing has been drawn yet, so the state read here
    # would differ from eager construction's, and restoring it later
    # (torch.random.fork_rng does) would replay different numbers.
    raise NotImplementedError("infinity.init: torch.get_rng_state() (or torch.random.fork_rng) inside the context "
                              "would see the generator before any initialisation drew from it, unlike eager "
                              "construction; seed with torch.manual_seed instead, or build this model eagerly")


def _recording(rec: Recorder, original: Callable) -> Callable:
    """``original`` (an nn.init function that skips meta tensors) recorded as one operation."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = args[0] if args else kwargs.get("tensor")
        # Bookkeeping only: the mode need not see the recorder's own queries.
        with torch._C.DisableTorchFunction():
            mine = isinstance(t, torch.Tensor) and rec.tracks(t)
            if mine:
                rec.observe(original, args, kwargs, t)
        if mine:
            return t
        return original(*args, **kwargs)

    wrapper.__name__ = original.__name__
    wrapper.__doc__ = original.__doc__
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper
