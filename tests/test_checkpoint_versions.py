"""Checkpoints across TorchTitan versions: the model keys each names (``spec.checkpoint_keys``), the
conversion tool (``tools.checkpoint_convert``) and the 0.2 adapter's refusal of a 0.3 checkpoint. The
0.3 side, a real 0.2.2 checkpoint trained on 0.3: ``tests_tt03/test_train_e2e.py``."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from titan_upipe.errors import ConfigError
from titan_upipe.spec.checkpoint_keys import model_key_for, written_by
from titan_upipe.tools import checkpoint_convert

KEYS_0_2 = ["tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.attention.wk.weight",
            "layers.0.attention.wv.weight", "layers.0.attention.wo.weight", "layers.0.attention.q_norm.weight",
            "layers.0.feed_forward.w1.weight", "norm.weight", "output.weight"]
KEYS_0_3 = ["tok_embeddings.weight", "layers.0.attention.qkv_linear.wq.weight",
            "layers.0.attention.qkv_linear.wk.weight", "layers.0.attention.qkv_linear.wv.weight",
            "layers.0.attention.wo.weight", "layers.0.attention.q_norm.weight", "layers.0.feed_forward.w1.weight",
            "norm.weight", "lm_head.weight"]


def test_the_model_keys_map_one_to_one_both_ways():
    assert [model_key_for(k, "0.3") for k in KEYS_0_2] == KEYS_0_3
    assert [model_key_for(k, "0.2") for k in KEYS_0_3] == KEYS_0_2
    assert (written_by(KEYS_0_2), written_by(KEYS_0_3), written_by(["norm.weight"])) == ("0.2", "0.3", None)
    assert written_by(["optimizer.state.output.weight.exp_avg", "norm.weight"]) is None  # not the model's


def save(path, keys) -> dict:
    state = {key: torch.randn(4, 3) for key in keys}
    state["optimizer.state.layers.0.attention.wq.weight.exp_avg"] = torch.zeros(4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return state


def test_convert_renames_the_model_and_leaves_the_rest(tmp_path, capsys):
    state = save(tmp_path / "v02", KEYS_0_2)
    assert checkpoint_convert.main([str(tmp_path / "v02"), str(tmp_path / "v03"), "--to", "0.3"]) == 0
    assert "9 model tensors under TorchTitan 0.3's names; left behind: optimizer" in capsys.readouterr().out
    assert sorted(FileSystemReader(str(tmp_path / "v03")).read_metadata().state_dict_metadata) == sorted(KEYS_0_3)
    assert checkpoint_convert.main([str(tmp_path / "v03"), str(tmp_path / "back"), "--to", "0.2"]) == 0
    back = {key: torch.empty(4, 3) for key in KEYS_0_2}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(back, checkpoint_id=str(tmp_path / "back"), no_dist=True)
    assert all(torch.equal(back[key], state[key]) for key in KEYS_0_2)
    # already 0.3's names; a folder that is not empty
    assert checkpoint_convert.main([str(tmp_path / "v03"), str(tmp_path / "again"), "--to", "0.3"]) == 1
    assert checkpoint_convert.main([str(tmp_path / "v02"), str(tmp_path / "v03"), "--to", "0.3"]) == 1
    err = capsys.readouterr().err
    assert "is not a TorchTitan 0.2.2 checkpoint: its model keys are already 0.3 names" in err
    assert "is not empty: give a new folder" in err


def test_the_0_2_adapter_refuses_a_0_3_checkpoint_with_the_conversion(tmp_path):
    from titan_upipe.torchtitan_0_2.config_parse import parse_config
    from titan_upipe.torchtitan_0_2.job_assets.checkpoints import check_initial_load

    save(tmp_path / "v03", KEYS_0_3)
    job = parse_config(["--job.config_file", "configs/debug/llama3_upipe.toml", "--job.dump_folder",
                        str(tmp_path / "out"), "--checkpoint.enable", "--checkpoint.initial_load_path",
                        str(tmp_path / "v03")], quiet=True)
    with pytest.raises(ConfigError, match=r"was written by TorchTitan 0.3, which names model keys otherwise .*"
                                          r"checkpoint_convert .* NEW_FOLDER --to 0.2"):
        check_initial_load(job)
