"""The optimizers' registry: every module of this package that defines an ``Optimizer`` with a ``name``.

Adding an optimizer is one file here (and its tests): the registry finds it,
``towers.Config`` gets the hyperparameters it declares (flags, checks, help,
resume rule: ``towers.settings``), ``towers.nn.models`` its defaults, and the
settings line and checkpoints its ``reads`` and slots.  See ``base.py`` for
what an optimizer declares.
"""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from towers.errors import UserError
from towers.optim.optimizers.base import Optimizer


def _discover() -> dict[str, type[Optimizer]]:
    found = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        for value in vars(importlib.import_module(f"{__name__}.{module}")).values():
            if isinstance(value, type) and issubclass(value, Optimizer) and value.name:
                if found.get(value.name, value) is not value:
                    raise TypeError(f"two optimizers are named {value.name!r}")
                found[value.name] = value
    return found


OPTIMIZERS: dict[str, type[Optimizer]] = _discover()
# Every optimizer's slot names: a checkpoint may hold another optimizer's (then they are dropped).
SLOTS = Optimizer.every_slot()

# For the names the rest of towers and its tests import from here.
SGD, Adam = OPTIMIZERS["sgd"], OPTIMIZERS["adam"]


def readers(name: str) -> tuple[str, ...]:
    """The optimizers whose update reads the setting ``name``, the one that declares it first."""
    return tuple(sorted((o for o, cls in OPTIMIZERS.items() if name in cls.reads),
                        key=lambda o: name not in OPTIMIZERS[o].settings))


def _used_by(optimizers: tuple[str, ...]):
    return lambda cfg: cfg.optimizer in optimizers


def settings() -> dict[str, dataclasses.Field]:
    """Every optimizer's declared hyperparameters, as ``Config`` fields (in use only with their readers)."""
    out = {}
    for cls in OPTIMIZERS.values():
        for name, f in cls.settings.items():
            if name in out:
                raise TypeError(f"setting {name!r} is declared by two optimizers")
            used = readers(name)
            out[name] = dataclasses.field(default=f.default, metadata={
                **f.metadata, "used_when": _used_by(used), "help": f"{f.metadata['help']} [{', '.join(used)}]"})
    return out


def defaults() -> dict[str, dict]:
    """{optimizer: the settings a run uses with it when the model gives none} (``towers.nn.models.GENERIC``)."""
    return {name: dict(cls.defaults) for name, cls in OPTIMIZERS.items()}


def check_given(cfg) -> None:
    """A hyperparameter given for an optimizer that does not read it is refused, whatever its value.

    ``cfg`` is not resolved yet but for its ``optimizer``: a hyperparameter is given when it differs
    from its declared default, which is unset (None; ``towers.settings.hyperparameter``) or off (a
    switch), so ``beta1`` 0.9 with sgd is given as much as 0.8 is.
    """
    for cls in OPTIMIZERS.values():
        for name, f in cls.settings.items():
            if cfg.optimizer not in readers(name) and getattr(cfg, name) != f.default:
                raise UserError(f"`{name}` is for `optimizer` {', '.join(readers(name))}, not {cfg.optimizer}; "
                                "drop it")


def check_settings(cfg) -> None:
    """The resolved optimizer's own rules between its settings."""
    OPTIMIZERS[cfg.optimizer].check(cfg)


def make_optimizer(cfg, params, ema=None) -> Optimizer:
    """The optimizer ``cfg.optimizer`` names, for one replica's flat buffer."""
    if cfg.optimizer not in OPTIMIZERS:
        raise UserError(f"optimizer {cfg.optimizer!r} is unknown: use one of {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[cfg.optimizer].from_config(cfg, params, ema)
