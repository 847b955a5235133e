"""``python -m titan_upipe.gpu_suite --next | --stage ...``: the GPU validation suite
(``titan_upipe.tools.gpu_suite``)."""

import os
import sys

from titan_upipe.adapter import require_command

if __name__ == "__main__":
    require_command("titan_upipe.gpu_suite")  # one line where the installed TorchTitan's adapter has no GPU suite
    from titan_upipe.tools.gpu_suite import main

    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.exit(main())
