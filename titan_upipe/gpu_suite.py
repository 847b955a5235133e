"""``python -m titan_upipe.gpu_suite --next | --stage ...``: the GPU validation suite
(``titan_upipe.tools.gpu_suite``)."""

import os
import sys

from titan_upipe.tools.gpu_suite import main

if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    sys.exit(main())
