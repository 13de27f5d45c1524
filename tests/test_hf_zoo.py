"""A zoo of tiny Hugging Face models built from configs: each plans and verifies.

GPT-2, BERT, ViT, Qwen2 (RoPE, GQA), BART (encoder-decoder, cross-attention) and Mixtral
(mixture of experts), from ``tests/models/hf_zoo.py``: keyword inputs with attention masks
where the model takes them, and the model's own loss from ``labels`` (no ``loss_fn``).
Each is planned for 2 GPUs with predicted (h100) and measured (cpu) costs.  Each also
verifies on CPU ranks against the unpartitioned model (fp32, 1e-5), each under another
schedule, in ``tests/test_model_matrix.py``'s default tier (every schedule in its full matrix).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from partitioner.graph.capture import split_call
from partitioner.modelfile import load_model_file
from partitioner.plan import Plan
from partitioner.search.planner import compile

MODELS = Path(__file__).parent / "models"
ZOO = ["gpt2", "bert", "vit", "qwen2", "bart", "mixtral"]
BATCH, MICROBATCHES = 4, 2


def _plan(name: str, device: str) -> Plan:
    model_file = load_model_file(str(MODELS / f"zoo_{name}.py"))
    assert model_file.loss_fn is None and model_file.target_keyword == "labels"
    return compile(model_file.build(), model_file.example_inputs(BATCH), gpus=2, pp=2,
                   microbatches=MICROBATCHES, schedule="1f1b", device=device)


@pytest.mark.parametrize("device", ["h100", "cpu"])
@pytest.mark.parametrize("name", ZOO)
def test_zoo_plans(name: str, device: str) -> None:
    plan = _plan(name, device)
    inputs = split_call(load_model_file(str(MODELS / f"zoo_{name}.py")).example_inputs(BATCH))[1]
    names = [t.name for t in plan.model.inputs]
    assert names == list(inputs), "flat inputs keep the keyword order"
    assert plan.model.capture == "export" and plan.pp == 2
    assert all(s.nodes for s in plan.stages)
    # labels feed the loss, computed in the graph by the last stage (BART's decoder reads them too:
    # its inputs are the labels shifted, so stage 0 reads them as well when it holds decoder layers).
    readers = [s.index for s in plan.stages if "labels" in s.model_inputs]
    assert readers in (([0, 1], [1]) if name == "bart" else ([1],)), readers
