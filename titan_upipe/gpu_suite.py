"""``python -m titan_upipe.gpu_suite --next | --stage ...``: the GPU validation suite
(``titan_upipe.tools.gpu_suite``)."""

import os
import sys

from titan_upipe.adapter import run_command

if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.exit(run_command("titan_upipe.gpu_suite"))  # one line where the installed TorchTitan's adapter has none
