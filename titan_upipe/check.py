"""``torchrun ... -m titan_upipe.check --job.config_file X.toml``: one step under the configured
layout against a single device (``titan_upipe.tools.parity``)."""

from titan_upipe.adapter import run_command

if __name__ == "__main__":
    run_command("titan_upipe.check")  # one line where the installed TorchTitan's adapter has no check
