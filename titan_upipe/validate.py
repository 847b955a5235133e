"""``python -m titan_upipe.validate X.toml --world-size N``: every problem of a job before launch
(``titan_upipe.tools.preflight``)."""

import sys

from titan_upipe.adapter import require_command

if __name__ == "__main__":
    require_command("titan_upipe.validate")  # one line where the installed TorchTitan's adapter has no validate
    from titan_upipe.tools.preflight import main

    sys.exit(main())
