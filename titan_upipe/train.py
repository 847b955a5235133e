"""``torchrun ... -m titan_upipe.train --job.config_file X.toml [--section.key value ...]``: TorchTitan's
trainer with the plugin (``titan_upipe.torchtitan_0_2.launch``); before any process group starts the
memory planner sizes what depends on the machine (``keep_attention = "auto"``)."""

from titan_upipe.plan.job_config import size_keep_attention_of_job
from titan_upipe.torchtitan_0_2.launch import main

if __name__ == "__main__":
    main(prepare=size_keep_attention_of_job)
