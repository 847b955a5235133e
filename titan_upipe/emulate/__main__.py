"""``python -m titan_upipe.emulate``: the rank emulator's command line (``titan_upipe.emulate.cli``)."""

import sys

from titan_upipe.emulate.cli import main

if __name__ == "__main__":
    sys.exit(main())
