"""Meta-built models: per-stage materialisation gives every tensor the values the whole model gets.

Unit tests materialise parts of models in one process and compare tensor by tensor
with :func:`materialise_model`; the rank tests train a meta-built GPT (pp=2 x dp=2) and
a meta-built Hugging Face Llama (pp=2) through ``verify``, whose reference is the
whole model materialised with the same seed: it checks that the ranks start from its
values (parameters and buffers) and match it over 3 SGD steps (fp32, 1e-5).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from planning_helpers import make_plan, parameters_covered
from torch import nn

from partitioner.errors import ModelFileError
from partitioner.modelfile import load_model_file
from runtime.state.materialise import holds_meta, init_seed, materialise_model, materialise_modules
from runtime.verify import verify

MODELS = Path(__file__).parent / "models"
META_GPT = str(MODELS / "meta_gpt.py")
META_LLAMA = str(MODELS / "meta_llama.py")


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}


def _meta_gpt() -> tuple[Callable[[], nn.Module], Callable[[nn.Module, str], None]]:
    import meta_gpt

    return meta_gpt.build_model, meta_gpt.init_weights


# ----------------------------------------------------------------- in one process


def test_parts_equal_the_whole_in_any_order() -> None:
    build, init = _meta_gpt()
    whole = _state(materialise_model(build(), seed=7, init_weights=init))
    assert not any(t.is_meta for t in whole.values())
    parts = build()
    # Last block first, then the head (tied to wte) and an embedding: order and grouping do not matter.
    for holders in ([parts.blocks[3]], [parts.lm_head, parts.wpe], [parts.blocks[0].attn, parts.ln_f]):
        materialise_modules(parts, holders, seed=7, init_weights=init)
    got = _state(parts)
    real = {n for n, t in got.items() if not t.is_meta}
    assert "blocks.3.mlp.c_fc.weight" in real and "blocks.0.attn.mask" in real and "wte.weight" in real
    assert "blocks.1.ln_1.weight" not in real and "blocks.0.ln_1.weight" not in real  # not asked for
    for name in real:
        assert torch.equal(got[name], whole[name]), name
    assert parts.lm_head.weight is parts.wte.weight  # a tie stays one tensor


def test_idempotent_and_real_models_untouched() -> None:
    build, init = _meta_gpt()
    model = materialise_model(build(), seed=1, init_weights=init)
    before = {n: (t, t.clone()) for n, t in _state(model).items()}
    materialise_model(model, seed=2, init_weights=init)  # nothing is on meta: nothing changes
    for name, (tensor, value) in before.items():
        assert _state(model)[name] is tensor and torch.equal(tensor, value), name
    assert not holds_meta(model)


def test_seeds_are_per_module_and_global_rng_is_untouched() -> None:
    build, init = _meta_gpt()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a = materialise_model(build(), seed=0, init_weights=init)
    assert torch.equal(torch.rand(3), expected)
    b = materialise_model(build(), seed=1, init_weights=init)
    assert not torch.equal(a.blocks[0].mlp.c_fc.weight, b.blocks[0].mlp.c_fc.weight)
    # Two blocks of the same shape get different values: each module has its own seed.
    assert not torch.equal(a.blocks[0].mlp.c_fc.weight, a.blocks[1].mlp.c_fc.weight)
    assert init_seed(0, "blocks.0") == 6787620671428033935  # pinned: stable across processes and versions


def test_buffers_and_fallbacks() -> None:
    """init_weights for Linear/Embedding/mask, reset_parameters() for LayerNorm, real buffers kept."""
    build, init = _meta_gpt()
    model = materialise_model(build(), seed=0, init_weights=init)
    n = model.blocks[0].attn.mask.shape[-1]
    assert torch.equal(model.blocks[0].attn.mask, torch.ones(n, n, dtype=torch.bool).tril().view(1, 1, n, n))
    assert torch.equal(model.ln_f.weight, torch.ones_like(model.ln_f.weight))  # LayerNorm.reset_parameters
    assert model.blocks[0].attn.c_attn.bias.abs().max() == 0
    assert 0.015 < float(model.blocks[0].attn.c_attn.weight.detach().std()) < 0.025  # N(0, 0.02)

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("scale", torch.arange(3.0, device="cpu"))  # explicit device: stays real

    with torch.device("meta"):
        scaled = Scaled()
    kept = scaled.scale
    materialise_model(scaled, seed=0)
    assert scaled.scale is kept and not scaled.lin.weight.is_meta


def test_hugging_face_llama_parts_equal_the_whole() -> None:
    """Llama's own _init_weights initialises every module; rotary inv_freq is recomputed from the config."""
    pytest.importorskip("transformers")
    spec = load_model_file(META_LLAMA)
    whole = materialise_model(spec.build(), seed=3)
    part = spec.build()
    materialise_modules(part, [part.model.layers[1], part.model.rotary_emb, part.lm_head], seed=3)
    got, want = _state(part), _state(whole)
    real = [n for n, t in got.items() if not t.is_meta]
    assert "model.rotary_emb.inv_freq" in real and "model.layers.1.input_layernorm.weight" in real
    assert "model.layers.0.mlp.up_proj.weight" not in real
    for name in real:
        assert torch.equal(got[name], want[name]), name
    import meta_llama

    built_real = meta_llama.llama._build(meta_llama.llama.TINY, meta=False)
    assert torch.equal(whole.model.rotary_emb.inv_freq, built_real.model.rotary_emb.inv_freq)
    assert torch.equal(whole.model.norm.weight, torch.ones_like(whole.model.norm.weight))


# ----------------------------------------------------------------- errors


class _Raw(nn.Module):
    """Holds a raw Parameter and has no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.gain = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.gain


def test_uninitialisable_parameter_names_module_and_fix() -> None:
    with torch.device("meta"):
        model = nn.Sequential(_Raw())
    with pytest.raises(ModelFileError) as info:
        materialise_model(model)
    message = str(info.value)
    assert "'0.gain'" in message and "module '0'" in message and "_Raw" in message
    assert "init_weights(module, name)" in message and "\n" not in message
    materialise_modules(model, [model[0].lin])  # the Linear alone is fine


def test_init_weights_that_leaves_a_tensor_unwritten() -> None:
    def init(module: nn.Module, name: str) -> None:
        if isinstance(module, nn.Linear):
            nn.init.zeros_(module.weight)  # but not the bias

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ModelFileError, match=r"initialised weight but not bias.*when name == '0'"):
        materialise_model(model, init_weights=init)


def test_writes_through_data_are_seen() -> None:
    """`.data` writes leave the version counter alone; the NaN marker shows them anyway."""

    def init(module: nn.Module, name: str) -> None:
        if isinstance(module, nn.Linear):
            module.weight.data.fill_(0.5)
            module.bias.data.zero_()

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    materialise_model(model, init_weights=init)
    assert torch.equal(model[0].weight, torch.full((2, 2), 0.5))  # not reset_parameters()' values
    assert torch.equal(model[1].weight, torch.ones(2))


def test_supply_gives_tensors_by_name() -> None:
    build, init = _meta_gpt()
    asked: list[str] = []

    def supply(wanted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        asked.extend(wanted)
        return {"ln_f.bias": torch.full(wanted["ln_f.bias"].shape, 3.0)}

    model = build()
    materialise_modules(model, [model.ln_f, model.lm_head], seed=0, init_weights=init, supply=supply)
    assert sorted(asked) == ["ln_f.bias", "ln_f.weight", "wte.weight"]  # the tie under its first name
    assert torch.equal(model.ln_f.bias, torch.full_like(model.ln_f.bias, 3.0))
    whole = materialise_model(build(), seed=0, init_weights=init)
    assert torch.equal(model.ln_f.weight, whole.ln_f.weight) and torch.equal(model.wte.weight, whole.wte.weight)


# ----------------------------------------------------------------- ranks


@pytest.mark.slow
def test_meta_gpt_pp2_dp2_equals_whole_model(tmp_path: Path) -> None:
    """Ranks materialise their stages; verify's reference materialises the whole model (seed 5)."""
    plan = make_plan(META_GPT, tmp_path, pp=2, dp=2, microbatches=2, schedule="1f1b")
    names, held = parameters_covered(plan, META_GPT)
    assert names <= held
    result = verify(tmp_path, META_GPT, steps=3, tolerance=1e-5, seed=5)
    assert result.ok, result.summary()
    assert result.start_diff.value == 0 and result.start_diff.total > 0  # same start, buffers included


@pytest.mark.slow
def test_meta_hugging_face_llama_through_pipeline(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    plan = make_plan(META_LLAMA, tmp_path, pp=2, microbatches=2, schedule="gpipe")
    result = verify(tmp_path, META_LLAMA, steps=3, tolerance=1e-5)
    assert result.ok, result.summary()
    assert result.start_diff.value == 0 and result.start_diff.total > 0
    assert plan.model.capture == "export"
