"""The adapter for TorchTitan 0.2.2 (``titan_upipe.adapter`` chooses it by the installed version)."""

COMMANDS = ("titan_upipe.train", "titan_upipe.validate", "titan_upipe.check", "titan_upipe.plan",
            "titan_upipe.emulate", "titan_upipe.gpu_suite")
"""The ``-m`` commands this adapter runs (``titan_upipe.adapter.require_command``: read without importing
the adapter's modules, so that a command it does not run stops at once)."""
