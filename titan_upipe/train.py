"""``torchrun ... -m titan_upipe.train --job.config_file X.toml [--section.key value ...]``: TorchTitan's
trainer with the plugin (``titan_upipe.torchtitan_0_2.launch``)."""

from titan_upipe.torchtitan_0_2.launch import main

if __name__ == "__main__":
    main()
