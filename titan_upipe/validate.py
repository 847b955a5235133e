"""``python -m titan_upipe.validate X.toml --world-size N``: every problem of a job before launch
(``titan_upipe.tools.preflight``)."""

import sys

from titan_upipe.tools.preflight import main

if __name__ == "__main__":
    sys.exit(main())
