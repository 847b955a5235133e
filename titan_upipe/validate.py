"""``python -m titan_upipe.validate X.toml --world-size N``: every problem of a job before launch
(``titan_upipe.tools.preflight`` on TorchTitan 0.2, ``titan_upipe.tools.spec_preflight`` on 0.3)."""

import sys

from titan_upipe.adapter import run_command

if __name__ == "__main__":
    # 0.2: tools.preflight; 0.3: tools.spec_preflight (the adapter's COMMANDS)
    sys.exit(run_command("titan_upipe.validate"))
