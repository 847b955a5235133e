"""``python -m titan_upipe.emulate``: the rank emulator's command line (``titan_upipe.emulate.cli``)."""

import sys

from titan_upipe.adapter import run_command

if __name__ == "__main__":
    sys.exit(run_command("titan_upipe.emulate"))  # one line where the installed TorchTitan's adapter has no emulator
