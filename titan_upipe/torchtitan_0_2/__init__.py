"""The adapter for TorchTitan 0.2.2 (``titan_upipe.adapter`` chooses it by the installed version)."""

COMMANDS = {
    "titan_upipe.train": "titan_upipe.torchtitan_0_2.launch:train_main",
    "titan_upipe.validate": "titan_upipe.tools.preflight:main",
    "titan_upipe.check": "titan_upipe.tools.parity:main",
    "titan_upipe.plan": "titan_upipe.tools.plan_cli:main",
    "titan_upipe.emulate": "titan_upipe.emulate.cli:main",
    "titan_upipe.gpu_suite": "titan_upipe.tools.gpu_suite:main",
}
"""The ``-m`` commands this adapter runs -> the ``module:function`` that runs each
(``titan_upipe.adapter.run_command``; read without importing the adapter's modules, so that a command it
does not run stops at once)."""
