"""``torchrun ... -m titan_upipe.train --job.config_file X.toml [--section.key value ...]``: TorchTitan's
trainer with the plugin: the installed TorchTitan's adapter's ``launch.train_main``. On 0.2.2, before any
process group starts, the memory planner refuses a job that does not fit this machine and sizes what
depends on it (``keep_attention = "auto"``): ``torchtitan_0_2.memory_guard.prepare_launch``."""

from titan_upipe.adapter import run_command

if __name__ == "__main__":
    # the installed TorchTitan's adapter's launch; one line where it cannot train
    run_command("titan_upipe.train")
