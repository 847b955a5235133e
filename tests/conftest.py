import os

# Tests run on CPU with gloo even on a GPU machine; importing titan_upipe first
# picks the device before TorchTitan reads it.
os.environ.setdefault("TITAN_UPIPE_DEVICE", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import titan_upipe  # noqa: E402,F401
