"""runner.models.loader: mapping HF safetensors into the fused layout, and errors that name the tensor."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runner.config import ConfigError, ModelConfig
from runner.models.loader import LoadError, load_model
from tests.support.tiny_models import load_hf

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llama_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama", seed=1)


@pytest.fixture(scope="module")
def tied_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen2", tie=True, seed=2)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_weights(folder: Path, edit) -> None:
    """Rewrite the single-file checkpoint with `edit(tensors)` applied."""
    f = folder / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def _load(folder: Path, dtype=torch.float32):
    return load_model(ModelConfig.from_pretrained(folder), CPU, dtype)


def test_unsupported_architecture_is_a_config_error(llama_dir, tmp_path):
    folder = _copy(llama_dir, tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    raw["architectures"] = ["MistralForCausalLM"]
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="architectures.*MistralForCausalLM"):
        _load(folder)


def test_fused_layout_matches_checkpoint_and_casts(llama_dir):
    files = load_file(str(llama_dir / "model.safetensors"))
    model = _load(llama_dir, torch.bfloat16)
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    pre = "model.layers.1."
    qkv = torch.cat([files[pre + f"self_attn.{x}_proj.weight"] for x in "qkv"])
    gate_up = torch.cat([files[pre + "mlp.gate_proj.weight"], files[pre + "mlp.up_proj.weight"]])
    assert torch.equal(params["layers.1.self_attn.qkv_proj.weight"], qkv.bfloat16())
    assert torch.equal(params["layers.1.mlp.gate_up_proj.weight"], gate_up.bfloat16())
    assert torch.equal(params["layers.1.post_attention_layernorm.weight"], files[pre + "post_attention_layernorm.weight"].bfloat16())
    # Untied: the head is its own tensor, loaded from lm_head.weight.
    assert torch.equal(model.lm_head.weight, files["lm_head.weight"].bfloat16())
    assert not torch.equal(model.lm_head.weight, model.embed_tokens.weight)


def test_missing_tensor_is_named(llama_dir, tmp_path):
    folder = _copy(llama_dir, tmp_path / "m")
    _edit_weights(folder, lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"))
    with pytest.raises(LoadError, match=re.escape("model.layers.1.self_attn.v_proj.weight")) as err:
        _load(folder)
    assert "missing" in str(err.value)


def test_unexpected_tensor_is_named_and_inv_freq_is_ignored(llama_dir, tmp_path):
    folder = _copy(llama_dir, tmp_path / "m")
    _edit_weights(folder, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    _load(folder)  # harmless extra: loads
    _edit_weights(folder, lambda t: t.update({"model.layers.0.mlp.extra_proj.weight": torch.ones(4, 4)}))
    with pytest.raises(LoadError, match=re.escape("model.layers.0.mlp.extra_proj.weight")) as err:
        _load(folder)
    assert "unexpected" in str(err.value)


def test_shape_mismatch_names_tensor_and_shapes(llama_dir, tmp_path):
    folder = _copy(llama_dir, tmp_path / "m")
    name = "model.layers.0.self_attn.k_proj.weight"
    _edit_weights(folder, lambda t: t.update({name: torch.zeros(48, 64)}))
    with pytest.raises(LoadError, match=re.escape(name)) as err:
        _load(folder)
    msg = str(err.value)
    assert "(32, 64)" in msg and "(48, 64)" in msg, msg


def test_no_safetensors_files(llama_dir, tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(llama_dir / "config.json", folder / "config.json")
    with pytest.raises(LoadError, match="no \\*.safetensors"):
        _load(folder)


def test_tied_head_absent_or_present_uses_embedding(tied_dir, tmp_path):
    assert "lm_head.weight" not in load_file(str(tied_dir / "model.safetensors"))
    model = _load(tied_dir)
    assert model.lm_head_weight is model.embed_tokens.weight
    assert not hasattr(model, "lm_head")
    hidden = torch.randn(3, model.cfg.hidden_size)
    ref = load_hf(tied_dir).lm_head(hidden)
    torch.testing.assert_close(model.compute_logits(hidden), ref, rtol=0, atol=1e-5)

    # A tied checkpoint that also stores a (here: different) head: the head is ignored.
    folder = _copy(tied_dir, tmp_path / "with_head")
    _edit_weights(folder, lambda t: t.update({"lm_head.weight": torch.randn_like(t["model.embed_tokens.weight"])}))
    torch.testing.assert_close(_load(folder).compute_logits(hidden), ref, rtol=0, atol=1e-5)


def test_untied_without_head_is_missing(llama_dir, tmp_path):
    folder = _copy(llama_dir, tmp_path / "m")
    _edit_weights(folder, lambda t: t.pop("lm_head.weight"))
    with pytest.raises(LoadError, match="missing.*'lm_head.weight'"):
        _load(folder)


def test_sharded_checkpoint_loads(llama_dir, tmp_path):
    folder = tmp_path / "sharded"
    load_hf(llama_dir).save_pretrained(folder, max_shard_size="100KB")
    shards = sorted(folder.glob("*.safetensors"))
    assert len(shards) > 1 and (folder / "model.safetensors.index.json").is_file()
    single = _load(llama_dir).state_dict()
    sharded = _load(folder).state_dict()
    assert single.keys() == sharded.keys()
    for k in single:
        assert torch.equal(single[k], sharded[k]), k

    # A shard the index names but that is gone is reported by file name.
    shards[0].unlink()
    with pytest.raises(LoadError, match=re.escape(shards[0].name)):
        _load(folder)


def test_unsupported_activation_is_refused(llama_dir, tmp_path):
    folder = _copy(llama_dir, tmp_path / "m")
    raw = json.loads((folder / "config.json").read_text())
    raw["hidden_act"] = "gelu"
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(LoadError, match="hidden_act 'gelu'"):
        _load(folder)


@pytest.mark.parametrize("which", ["llama", "tied"])
def test_padded_head_gives_the_same_logits(which, llama_dir, tied_dir):
    """pad_lm_head (done on CUDA at construction, for cuBLAS alignment) stores the head as the
    first V rows of a longer zero-padded tensor: same logits, full or a span, same embedding."""
    folder = llama_dir if which == "llama" else tied_dir
    ref, model = _load(folder), _load(folder)
    v = model.cfg.vocab_size
    model.pad_lm_head(multiple=v + 37)  # never a divisor: always pads
    padded = model.lm_head_padded
    assert padded.shape[0] == v + 37
    assert padded.data_ptr() == model.lm_head_weight.data_ptr() and not padded[v:].any()
    hidden = torch.randn(3, model.cfg.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), ref.compute_logits(hidden), rtol=0, atol=0)
    for rows in (hidden, hidden[:1]):  # row stride V, also for a single row
        assert model.compute_logits(rows).stride() == (v, 1)
    torch.testing.assert_close(model.compute_logits(hidden, (5, 17)), ref.compute_logits(hidden)[:, 5:17], rtol=0, atol=1e-6)
    ids = torch.tensor([0, 3, v - 1])
    torch.testing.assert_close(model.embed_tokens(ids), ref.embed_tokens(ids), rtol=0, atol=0)


@pytest.mark.parametrize("which", ["llama", "tied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_ids_are_the_argmax_of_the_logits(which, dtype, llama_dir, tied_dir):
    """greedy_ids (the runner's path for all-greedy rows: no fp32 copy of the logits) picks what
    argmax over compute_logits picks, with the head padded or not; on a tie (all-zero hidden
    rows: every logit 0) both pick the first index."""
    folder = llama_dir if which == "llama" else tied_dir
    model = _load(folder, dtype)
    hidden = torch.cat([torch.randn(5, model.cfg.hidden_size), torch.zeros(2, model.cfg.hidden_size)]).to(dtype)
    want = model.compute_logits(hidden).argmax(-1)
    assert want[-1] == 0 and torch.equal(model.greedy_ids(hidden), want)
    model.pad_lm_head(multiple=model.cfg.vocab_size + 37)
    assert torch.equal(model.greedy_ids(hidden), want)
