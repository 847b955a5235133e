"""``torchrun ... -m titan_upipe.train --job.config_file X.toml [--section.key value ...]``: TorchTitan's
trainer with the plugin (``titan_upipe.torchtitan_0_2.launch``); before any process group starts the
memory planner refuses a job that does not fit this machine and sizes what depends on it
(``keep_attention = "auto"``): ``torchtitan_0_2.memory_guard.prepare_launch``."""

from titan_upipe.adapter import require_command

if __name__ == "__main__":
    require_command("titan_upipe.train")  # one line where the installed TorchTitan's adapter cannot train yet
    from titan_upipe.torchtitan_0_2.launch import main
    from titan_upipe.torchtitan_0_2.memory_guard import prepare_launch

    main(prepare=prepare_launch)
