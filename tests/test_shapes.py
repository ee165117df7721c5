"""lctrain.shapes: every named shape's `model.arch` dict builds, through transformers' own config, the very shape
the table names; the base models' hub names resolve to their shapes without a download."""

import pytest
from transformers import AutoConfig

from lctrain.config import load_config
from lctrain.costmodel import ModelShape
from lctrain.model import model_shape, shape_without_download
from lctrain.shapes import HUB_NAMES, POSITIONS, SHAPES, hf_arch


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_the_arch_dict_is_the_named_shape(name):
    arch = hf_arch(SHAPES[name])
    assert arch["model_type"] == "llama" and "vocab_size" not in arch
    fields = {k: v for k, v in arch.items() if k != "model_type"}
    assert (
        ModelShape.from_hf_config(AutoConfig.for_model("llama", vocab_size=SHAPES[name].vocab, **fields))
        == SHAPES[name]
    )


def test_a_head_dim_other_than_hidden_over_heads_is_kept():
    arch = hf_arch(ModelShape(2, 64, 4, 2, 32, 128, 100))
    assert arch["head_dim"] == 32 and "head_dim" not in hf_arch(SHAPES["llama2-7b"])


def test_base_models_are_known_by_their_hub_names():
    llama2 = load_config("llama2_128k_anchor")
    assert llama2.model.name_or_path == "meta-llama/Llama-2-7b-hf"
    assert shape_without_download(llama2)
    assert model_shape(llama2) == ModelShape(32, 4096, 32, 32, 128, 11008, 32000)  # its config.json
    assert set(HUB_NAMES.values()) <= set(SHAPES)


def test_every_base_model_has_its_own_rope_base_and_context_length():
    assert set(POSITIONS) == set(HUB_NAMES.values())
    assert POSITIONS["llama2-7b"].rope_theta == 10_000 and POSITIONS["llama2-7b"].max_positions == 4096
    assert POSITIONS["qwen2.5-7b"].rope_theta == 1e6 and POSITIONS["llama3.1-8b"].rope_type == "llama3"
