"""Reading a checkpoint's own description of itself, cheaply: a DCP folder's ``.metadata`` (its
tensors, their shapes, the byte ranges of each ``.distcp`` shard file) and the headers of Hugging
Face ``*.safetensors`` files, and a few small values a DCP checkpoint saved beside its tensors
(the data cursor). Nothing here reads a tensor.

Each problem is a :class:`~titan_upipe.errors.ConfigError` naming the file; ``fix`` is the
caller's advice for that checkpoint (it differs for a resume point and an initial load).
"""

from __future__ import annotations

import glob
import json
import os

from titan_upipe.errors import ConfigError
from titan_upipe.torchtitan_0_2.job_assets.model_state import NON_MODEL_STATES, Shapes

SAFETENSORS_HEADER_BYTES = 8
"""A safetensors file starts with its JSON header's length, a little-endian u64."""


def read_metadata(path: str, fix: str):
    """The ``torch.distributed.checkpoint`` metadata of the folder ``path`` (its ``.metadata``)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return FileSystemReader(path).read_metadata()
    except Exception as err:  # a truncated pickle raises UnpicklingError, EOFError, …: all mean "unreadable"
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"{os.path.join(path, '.metadata')} cannot be read ({type(err).__name__}: {reason}): the "
                          f"checkpoint is cut short or not a DCP checkpoint; {fix}") from None


def checkpoint_keys(path: str) -> set[str]:
    """The flattened state keys of a DCP checkpoint (reads its ``.metadata`` only)."""
    return set(read_metadata(path, "fix or remove the checkpoint").state_dict_metadata)


def read_values(path: str, defaults: dict, fix: str) -> dict:
    """The small non-tensor entries that ``defaults`` names, read from the DCP checkpoint ``path``
    (nested as saved, e.g. ``{"dataloader": {"stream": {"file": -1}}}``; an entry the checkpoint
    lacks keeps its default). Reads those entries' bytes only, no tensor."""
    import copy
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    values = copy.deepcopy(defaults)
    try:
        with warnings.catch_warnings():  # ("torch.distributed is disabled …": one process, as intended)
            warnings.simplefilter("ignore")
            dcp.load(values, checkpoint_id=path, no_dist=True, planner=DefaultLoadPlanner(allow_partial_load=True))
    except Exception as err:  # an unreadable shard: the same problem the shard checks name, from the reader
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"{path} cannot be read ({type(err).__name__}: {reason}): {fix}") from None
    return values


def bytes_needed_per_file(metadata) -> dict[str, int]:
    """Shard file (relative path) -> the end of the last byte range the metadata reads from it."""
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    return needed


def check_shards(path: str, metadata, fix: str) -> None:
    """Every ``.distcp`` file the metadata reads exists and holds the byte ranges it reads."""
    try:
        needed_per_file = bytes_needed_per_file(metadata)
    except (AttributeError, TypeError) as err:  # metadata unpickled, but not of a FileSystemWriter's save
        raise ConfigError(f"{path}/.metadata names no shard files ({type(err).__name__}: {err}): the checkpoint "
                          f"was not written by torch.distributed.checkpoint's file system writer; {fix}") from None
    for name, needed in sorted(needed_per_file.items()):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise ConfigError(f"{file} is missing but {path}/.metadata reads {needed} bytes from it: the checkpoint "
                              f"is incomplete; {fix}")
        size = os.path.getsize(file)
        if size < needed:
            raise ConfigError(f"{file} holds {size} bytes but {path}/.metadata reads {needed} from it: the file is "
                              f"cut short (a save or copy interrupted, or a full disk); {fix}")


def model_shapes(metadata) -> Shapes:
    """The model's tensors in a DCP checkpoint: name -> global shape (every entry but the
    optimizer's, the scheduler's, the data loader's and the train state)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {key: tuple(entry.size) for key, entry in metadata.state_dict_metadata.items()
            if key.split(".", 1)[0] not in NON_MODEL_STATES and isinstance(entry, TensorStorageMetadata)}


def _safetensors_header(file: str, fix: str) -> dict:
    try:
        return _read_safetensors_header(file, fix)
    except OSError as err:
        raise ConfigError(f"{file} cannot be read ({err.strerror or err}): {fix}") from None


def _read_safetensors_header(file: str, fix: str) -> dict:
    size = os.path.getsize(file)
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(SAFETENSORS_HEADER_BYTES), "little")
        if size < SAFETENSORS_HEADER_BYTES or SAFETENSORS_HEADER_BYTES + length > size:
            raise ConfigError(f"{file} holds {size} bytes, less than its header: the file is cut short; {fix}")
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ConfigError(f"{file} has no readable safetensors header ({err}): {fix}") from None
    try:  # a header that is JSON but not safetensors' (a dict of {dtype, shape, data_offsets})
        tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
        end = SAFETENSORS_HEADER_BYTES + length + max((int(entry["data_offsets"][1]) for entry in tensors.values()),
                                                      default=0)
        [tuple(entry["shape"]) for entry in tensors.values()]
    except (AttributeError, KeyError, TypeError, IndexError, ValueError) as err:
        raise ConfigError(f"{file} is not a safetensors file (its header lacks tensor shapes or offsets: "
                          f"{type(err).__name__}): {fix}") from None
    if size < end:
        raise ConfigError(f"{file} holds {size} bytes but its header places tensors up to byte {end}: the file is "
                          f"cut short (an interrupted download?); {fix}")
    return tensors


def safetensors_shapes(folder: str, fix: str) -> Shapes:
    """Name -> shape of every tensor in the folder's ``*.safetensors`` files (their headers, each
    checked against the file's size)."""
    shapes: Shapes = {}
    for file in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        shapes.update({name: tuple(entry["shape"]) for name, entry in _safetensors_header(file, fix).items()})
    return shapes
