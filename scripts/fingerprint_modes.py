"""A bitwise fingerprint of the converted model's step, for refactors that must not change a bit.

    torchrun --nproc_per_node <CP degree> scripts/fingerprint_modes.py --job.config_file X.toml [check args]

Runs the parity check's parallel step (``titan_upipe.tools.parity``: the config's converters on this
rank's shard, prepared as the trainer prepares it, fp32) and, on rank 0, prints one JSON line instead
of the comparison: the parameter FQNs, the loss as ``float.hex``, and SHA-256 digests of the
gathered logits and of every gradient (sorted by FQN). Two trees give equal lines exactly when
the FQNs, the loss, the logits and every gradient are bitwise equal.
Used for issue 43 (a ``git worktree`` of the parent commit against the working tree).
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from titan_upipe.tools import parity


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().float().contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def _fingerprint(setup, reference, loss_fn, inputs, labels, n_tokens, loss_sum, logits, grads, runs=None) -> bool:
    record = {"config": str(setup.job_config.job.config_file).rsplit("/", 1)[-1],
              "fqns": sorted(grads), "loss": float(loss_sum).hex(), "logits": _digest(logits),
              "grads": _digest(torch.cat([grads[name].flatten() for name in sorted(grads)]))}
    print("FINGERPRINT " + json.dumps(record, sort_keys=True), flush=True)
    return False


if __name__ == "__main__":
    parity._compare = _fingerprint  # this script's own hook into the check (not the package's behaviour)
    sys.exit(parity.run_check(sys.argv[1:]))
