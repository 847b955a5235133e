"""The converted model's layout check runs on every forward (training and validation alike)."""

import pytest
import torch

from titan_upipe.errors import ConfigError
from titan_upipe.parallel import shard_sequence
from titan_upipe.parallel.inputs import LayoutCheck


class RingMesh:
    """Rank 1 of a 1-D ring mesh of 2 (zigzag layout), without processes."""

    ndim = 1
    mesh_dim_names = ("ring",)

    def size(self, dim=None):
        return 2

    def get_local_rank(self, dim=None):
        return 1


def test_every_forward_is_checked_not_only_the_first():
    mesh = RingMesh()
    check = LayoutCheck(mesh)
    tokens = torch.zeros(1, 8, dtype=torch.long)
    _, zigzag = shard_sequence(torch.arange(16)[None], mesh, seq_dim=1)
    assert zigzag.tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # chunks 1 and 2 of 4
    check(None, (tokens,), {"positions": zigzag})
    check(None, (tokens,), {"positions": zigzag})
    # A later forward with another sharding (e.g. TorchTitan's validator: head-tail / contiguous)
    # is refused although the first forwards passed.
    with pytest.raises(ConfigError, match="not in titan_upipe's sequence layout"):
        check(None, (tokens,), {"positions": torch.arange(8, 16)})
    with pytest.raises(ConfigError, match="not in titan_upipe's sequence layout"):
        check(None, (tokens,), {})
