"""--nvlink-domain: an NVLink domain over several hosts (GB200 NVL72), so tp and ep groups may span hosts."""

import sys
from pathlib import Path

import pytest

import partitioner
from partitioner.errors import AutopartitionError
from partitioner.report.table import assumptions

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))


def _llama():
    import llama

    return llama.build_model(), llama.example_inputs(8)


def test_a_tensor_parallel_group_spans_hosts_inside_the_domain_and_the_report_says_so():
    model, inputs = _llama()
    plan = partitioner.compile(model, inputs, gpus=16, device="gb200", gpus_per_node=2, nvlink_domain=8, tp=4,
                               pp=2, microbatches=2, precision="bf16-mixed")
    assert (plan.tp, plan.gpus_per_node, plan.gpus_per_host) == (4, 8, 2)
    said = dict(assumptions(plan))
    assert "across 2 hosts of 2" in said["tensor parallel"] and "NVLink domain" in said["tensor parallel"]
    assert "(4 hosts of 2 each: one NVLink domain)" in said["links"]
    again = partitioner.Plan.from_json(plan.to_json())
    assert again.gpus_per_host == 2


def test_without_the_domain_a_group_stays_inside_a_host():
    model, inputs = _llama()
    with pytest.raises(AutopartitionError, match="--tp 4 must divide --gpus-per-node 2"):
        partitioner.compile(model, inputs, gpus=16, device="gb200", gpus_per_node=2, tp=4)


def test_a_domain_that_is_not_whole_hosts_is_refused():
    model, inputs = _llama()
    with pytest.raises(AutopartitionError, match="--nvlink-domain 6 must be a whole number of hosts of --gpus-per-node 4"):
        partitioner.compile(model, inputs, gpus=24, device="gb200", gpus_per_node=4, nvlink_domain=6)
