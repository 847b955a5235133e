"""``python -m titan_upipe.plan``: the planner's command line (``titan_upipe.tools.plan_cli``).

The arguments are read first, without torch or TorchTitan (``tools.plan_arguments``): ``--help`` and a
bad argument answer in a fraction of a second. Only a run loads the command (and with a TOML, the
TorchTitan adapter that parses it): the one deferred import of the package, allowed in ``-m``
entry modules (``tests/test_layers.py``).
"""

import sys

from titan_upipe.tools.plan_arguments import build_parser


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_known_args(sys.argv[1:] if argv is None else argv)  # exits on --help or an error
    from titan_upipe.tools.plan_cli import main as run  # torch and TorchTitan: only for a run

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
