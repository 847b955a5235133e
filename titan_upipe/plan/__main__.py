"""``python -m titan_upipe.plan``: the planner's command line (``titan_upipe.plan.cli``)."""

import sys

from titan_upipe.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
