"""What TorchTitan's own entry point (``torchrun ... -m torchtitan.train``) cannot run, refused there
in one line before any process group starts.

``-m torchtitan.train`` imports ``titan_upipe.plugin`` (its ``experimental.custom_import``) at the
top of ``Trainer.__init__``, before ``init_distributed``. A job with a context-parallel converter
cannot train there: TorchTitan's trainer shards CP inputs head-tail, not in the layout the converted
attention reads. The converted model would refuse those inputs at its first forward
(``parallel.inputs.LayoutCheck``), after the process groups, inside a traceback on every rank;
here the plugin's import refuses the job first: rank 0 prints the one line with the fix
(``titan_upipe.errors.exit_once``) and every rank exits with status 2.
"""

from __future__ import annotations

import sys

from titan_upipe.errors import ConfigError, exit_once
from titan_upipe.spec.cp_layout import cp_mode
from titan_upipe.torchtitan_0_2.config_parse import parse_config

TORCHTITAN_TRAIN = "torchtitan.train"


def launched_module() -> str | None:
    """The module ``python -m`` runs in this process (``__main__``'s spec), None for a script or
    an interactive interpreter."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return getattr(spec, "name", None)


def torchtitan_train_problem(args: list[str]) -> str | None:
    """Why TorchTitan's trainer cannot run the job of ``args`` (a CP converter), or None. A config
    this parser refuses is left to TorchTitan, which parsed it, and to the job checks its
    ``parallelize_fn`` runs."""
    try:
        mode = cp_mode(list(parse_config(args, quiet=True).model.converters))
    except ConfigError:
        return None
    if mode is None:
        return None
    return (f"model.converters has {mode.value!r}: TorchTitan's trainer would shard its context-parallel inputs "
            "head-tail, not in titan_upipe's sequence layout; launch the same command with "
            "`-m titan_upipe.train` instead of `-m torchtitan.train`")


def refuse_unsupported_launch() -> None:
    """Under ``-m torchtitan.train``: a job it cannot run stops this rank (module docstring)."""
    if launched_module() != TORCHTITAN_TRAIN:
        return
    if problem := torchtitan_train_problem(sys.argv[1:]):
        raise exit_once(TORCHTITAN_TRAIN, problem)
