"""The command line: ``python -m towers.train`` (``towers-train`` when installed).

A thin layer over the library: flags become a ``towers.Config`` (one flag per
field, derived from its declaration: ``towers.settings``), ``towers.Trainer(cfg).fit()``
trains, and errors become one line on stderr with exit status 2 (a user mistake)
or 1 (a run that cannot go on).
Library messages name settings; inside ``flags_in_messages`` they show as flags.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from towers.cli import Parser, run_main, show_notices, sigterm_raises, warn_about
from towers.config import Config
from towers.errors import flags_in_messages
from towers.settings import GROUPS, flag_name, help_text, metavar
from towers.run.trainer import Trainer

def _number(kind):
    def parse(text):
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
    parse.__name__ = kind.__name__
    return parse


NAME = "towers.train"  # in its error lines (docs/errors.md's)


def build_parser(prog: str = "python -m towers.train") -> argparse.ArgumentParser:
    """One flag per ``Config`` field, its help, type and metavar from the field's declaration.

    ``--help`` lists the flags under one heading per group (``towers.settings.GROUPS``: their order and
    one-line descriptions), not all under ``options:``; the usage line names no flag, since the 60-odd of
    them filled 27 lines before the first heading.  A flag not typed is absent from the parsed namespace
    (``argparse.SUPPRESS``): the ``Config`` made of it knows which settings were given (``Config.given``),
    and a resume takes the others from its checkpoint.
    """
    ap = Parser(prog=prog, name=NAME, usage="%(prog)s [-h] [--FLAG [VALUE] ...]",
                description="Multi-tower training with CuPy + NCCL, or NumPy on the CPU.")
    groups = {name: ap.add_argument_group(name, description) for name, description in GROUPS.items()}
    for f in fields(Config):
        help_ = help_text(f).replace("%", "%%").replace("`", "")
        group = groups[f.metadata["group"]]
        if f.metadata["type"] == "bool":  # on by default: the flag (--no-...) turns it off
            group.add_argument(flag_name(f), dest=f.name, action="store_false" if f.default else "store_true",
                               default=argparse.SUPPRESS, help=help_)
        else:
            kind = f.metadata["check"].arg_type
            group.add_argument(flag_name(f), dest=f.name, type=_number(kind) if kind is not str else str,
                               default=argparse.SUPPRESS, metavar=metavar(f), help=help_)
    return ap


def parse_config(argv=None, prog: str = "python -m towers.train") -> Config:
    """The ``Config`` of the flags in ``argv``: those typed are its ``given`` settings, the rest their defaults."""
    return Config(**vars(build_parser(prog).parse_args(argv)))


def run(cfg: Config) -> dict:
    """Train as ``cfg`` says; return the final metrics (the command line's whole job)."""
    show_notices()
    with Trainer(cfg) as trainer:  # Ray is imported only for `hosts` > 1: one host never pays for it
        warn_about(trainer.dataset, NAME)
        if trainer.cfg.log_placement:
            print(trainer.executor.placement_text(), flush=True)
        return trainer.fit()


def main(argv=None, prog: str = "towers-train") -> int:
    """The command line (``towers-train``, ``python -m towers.train``: ``prog``, the command its usage line names);
    returns the exit status."""
    with flags_in_messages():
        return _main(argv, prog)


def _main(argv, prog) -> int:
    cfg = parse_config(argv, prog)
    def body():
        with sigterm_raises():  # SIGTERM ends the run like Ctrl-C: writers clean up, one line, status 143
            run(cfg)

    return run_main(NAME, body, terminated="terminated (SIGTERM); the last checkpoint is kept")


if __name__ == "__main__":
    sys.exit(main(prog="python -m towers.train"))
