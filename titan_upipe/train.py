"""``torchrun ... -m titan_upipe.train --job.config_file X.toml [--section.key value ...]``: TorchTitan's
trainer with the plugin (``titan_upipe.torchtitan_0_2.launch``); before any process group starts the
memory planner refuses a job that does not fit this machine and sizes what depends on it
(``keep_attention = "auto"``): ``torchtitan_0_2.memory_guard.prepare_launch``."""

from titan_upipe.torchtitan_0_2.launch import main
from titan_upipe.torchtitan_0_2.memory_guard import prepare_launch

if __name__ == "__main__":
    main(prepare=prepare_launch)
