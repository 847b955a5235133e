"""``python -m titan_upipe.tools.checkpoint_convert SRC DST --to 0.3``: a TorchTitan checkpoint's model
weights under the other version's names (``spec.checkpoint_keys``), as a model-only DCP checkpoint.

A job moving from TorchTitan 0.2.2 to 0.3 (or back) loads DST with ``checkpoint.initial_load_path =
DST`` (and ``checkpoint.load_only`` for a reference run). The optimizer state, LR schedule, data cursor
and step are left behind: their formats differ between the versions, so the moved job starts its
optimizer afresh from the converted weights. Runs in one process, without TorchTitan; reads the model
tensors only. Exit code 0 on success, 1 when SRC is not a checkpoint of the other version or DST is
not empty, 2 on usage errors.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from titan_upipe.spec.checkpoint_keys import VERSIONS, is_model_key, model_key_for, written_by
from titan_upipe.toolkit.cli_args import ToolParser

TOOL = "python -m titan_upipe.tools.checkpoint_convert"


def convert(src: str, dst: str, to: str) -> tuple[int, list[str]]:
    """Write SRC's model tensors to DST under TorchTitan ``to``'s names; (tensors written, the other
    entries left behind). ValueError: SRC is not a checkpoint of the other version, DST holds files."""
    metadata = FileSystemReader(src).read_metadata().state_dict_metadata
    source = written_by(metadata)
    if source == to or source is None:
        raise ValueError(f"{src} is not a TorchTitan {'0.2.2' if to == '0.3' else '0.3'} checkpoint: its model keys are "
                         f"{'already ' + to + ' names' if source == to else 'the same on both versions'}; load it as "
                         "it is")
    if Path(dst).exists() and any(Path(dst).iterdir()):
        raise ValueError(f"{dst} is not empty: give a new folder")
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype) for key, meta in metadata.items()
               if is_model_key(key) and isinstance(meta, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(tensors, checkpoint_id=src, no_dist=True)
        dcp.save({model_key_for(key, to): value for key, value in tensors.items()}, checkpoint_id=dst, no_dist=True)
    return len(tensors), sorted({key.split(".")[0] for key in metadata if not is_model_key(key)})


def main(argv: list[str] | None = None) -> int:
    parser = ToolParser(prog=TOOL, description=__doc__.splitlines()[0])
    parser.add_argument("src", help="a checkpoint step folder (…/checkpoint/step-N)")
    parser.add_argument("dst", help="the new checkpoint's folder (created; must be empty)")
    parser.add_argument("--to", choices=VERSIONS, required=True, help="the TorchTitan version that will load DST")
    args = parser.parse_args(argv)
    try:
        written, left = convert(args.src, args.dst, args.to)
    except (ValueError, FileNotFoundError) as err:
        print(f"{TOOL}: error: {err}", file=sys.stderr)
        return 1
    print(f"{args.dst}: {written} model tensors under TorchTitan {args.to}'s names"
          + (f"; left behind: {', '.join(left)} (their formats differ between the versions)" if left else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
