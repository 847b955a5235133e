"""``torchrun ... -m titan_upipe.check --job.config_file X.toml``: one step under the configured
layout against a single device (``titan_upipe.tools.parity``)."""

from titan_upipe.tools.parity import main

if __name__ == "__main__":
    main()
