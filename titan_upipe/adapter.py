"""Which TorchTitan adapter runs: chosen by the installed TorchTitan's version, here and nowhere else.

============== ================================= ================================================
TorchTitan     adapter package                   what it hosts
============== ================================= ================================================
0.2.x          ``titan_upipe.torchtitan_0_2``    every feature (the default install)
0.3.x          ``titan_upipe.torchtitan_0_3``    recipes read into a ``Trainer.Config`` and the
                                                 same ``JobSpec``; ``train`` (every CP mode but
                                                 TSP), ``validate``, ``plan``
                                                 (docs/torchtitan_versions.md)
============== ================================= ================================================

The version is read from the installed distribution's metadata (``importlib.metadata``), so this
module imports no TorchTitan and has no side effect on import.
"""

from __future__ import annotations

import importlib
from importlib import metadata

from titan_upipe.errors import ConfigError, exit_once

ADAPTERS = {"0.2": "titan_upipe.torchtitan_0_2", "0.3": "titan_upipe.torchtitan_0_3"}
"""``major.minor`` of a TorchTitan release -> the adapter package that speaks its API."""

INSTALL_HINT = ("pip install torchtitan==0.2.2 (every feature; `make install`), or torchtitan==0.3.0 beside it "
                "(`make install` builds that environment too: docs/torchtitan_versions.md)")


def installed_torchtitan_version() -> str | None:
    """The installed TorchTitan's version (None: not installed)."""
    try:
        return metadata.version("torchtitan")
    except metadata.PackageNotFoundError:
        return None


def adapter_package(version: str | None = None) -> str:
    """The adapter package for TorchTitan ``version`` (default: the installed one). Raises ConfigError
    naming the supported versions for one no adapter speaks, or none installed."""
    version = installed_torchtitan_version() if version is None else version
    if version is None:
        raise ConfigError(f"TorchTitan is not installed: {INSTALL_HINT}")
    release = ".".join(version.split(".")[:2])
    if release not in ADAPTERS:
        raise ConfigError(f"torchtitan {version} is not supported by titan_upipe: valid versions are "
                          f"{', '.join(f'{r}.x' for r in ADAPTERS)}; {INSTALL_HINT}")
    return ADAPTERS[release]


def adapter_module(name: str):
    """``<adapter>.<name>`` for the installed TorchTitan: how a version-neutral tool reaches the adapter's
    door (``load_job``: ``spec_of_recipe``, ``flavor_model_dims``), imported on first use."""
    return importlib.import_module(f"{adapter_package()}.{name}")


def require_command(command: str) -> str:
    """Where the installed TorchTitan's adapter runs ``command`` (``"titan_upipe.tools.preflight:main"``:
    its package's ``COMMANDS``, read without importing the adapter's modules); otherwise exit with one
    line naming what it hosts and the install that runs it (status 2)."""
    try:
        hosted = importlib.import_module(adapter_package()).COMMANDS
    except ConfigError as err:  # no TorchTitan, or a version no adapter speaks
        raise exit_once(command, str(err)) from None
    if command not in hosted:
        raise exit_once(command, f"{command} does not run on torchtitan {installed_torchtitan_version()} yet: its "
                                 f"adapter runs {', '.join(hosted)}; run {command} on torchtitan 0.2.2 (`make "
                                 "install`'s .venv, without .tt03 on PYTHONPATH: docs/torchtitan_versions.md)") from None
    return hosted[command]


def run_command(command: str):
    """Run ``command`` as the installed TorchTitan's adapter hosts it (:func:`require_command`) and return
    what its entry function returns (the ``-m`` shims' exit status)."""
    module, function = require_command(command).split(":")
    return getattr(importlib.import_module(module), function)()
