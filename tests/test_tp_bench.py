"""tools/bench_large.py's published layouts (issue 22): the table's data, rows and verdict, and one tiny group end to end.

Fast (no rank spawns), so not in tests/test_bench_tools.py, whose every test is marked slow.
"""

from __future__ import annotations

import pytest

from partitioner.search.price import Layout
from tools.bench_large import PUBLISHED, PublishedGroup, print_published, run_published_child


@pytest.mark.parametrize("group", PUBLISHED, ids=lambda g: g.name)
def test_published_layouts_are_consistent(group: PublishedGroup) -> None:
    for keywords in group.layouts:
        layout = Layout(gpus=group.gpus, **keywords)  # tp x pp x dp = GPUs, or ValueError
        assert 8 % layout.tp == 0, "a tensor-parallel group stays inside an 8-GPU node"
        assert group.batch % (layout.dp * layout.microbatches) == 0, layout
        assert (layout.chunks or 1) > 1 or layout.schedule != "interleaved-1f1b"
        assert layout.source, "each published layout says where it was published"


def test_tiny_group_end_to_end(capsys: pytest.CaptureFixture[str]) -> None:
    # Only the layout is priced (search_tp=False): --tp auto and --tp 1 are compile() as tested elsewhere.
    group = PublishedGroup("tiny", "examples/gpt.py", 4, 8, 16, (
        {"name": "hand TP2 PP2", "tp": 2, "pp": 2, "dp": 1, "microbatches": 4, "schedule": "1f1b",
         "shard": "none", "recompute": "none", "source": "a test"},), search_tp=False)
    result = run_published_child(group)
    (hand,) = result["rows"]
    assert (hand["layout"], hand["tp"], hand["pp"], hand["dp"], hand["fits"]) == ("hand TP2 PP2", 2, 2, 1, True)
    assert hand["tokens_per_s_per_gpu"] == pytest.approx(8 * 16 / hand["step_s"] / 4)
    assert print_published([result])  # no "ours" row: nothing to be slower than
    table = capsys.readouterr().out
    assert "| tiny (4 GPUs, 8 x 16) | hand TP2 PP2 | 2 x 2 x 1 | 4, 1f1b |" in table


def test_verdict_counts_only_published_layouts_that_fit(capsys: pytest.CaptureFixture[str]) -> None:
    def row(layout: str, step: float, *, fits: bool, source: str = "") -> dict[str, object]:
        return {"layout": layout, "tp": 1, "pp": 1, "dp": 1, "chunks": 1, "microbatches": 1, "schedule": "1f1b",
                "shard": "none", "recompute": "none", "step_s": step, "mfu": None, "peak_bytes": 1e9, "fits": fits,
                "tokens_per_s_per_gpu": 1.0, "wall_s": 0.0, "source": source}

    ours = row("ours (--tp auto)", 2.0, fits=True)
    result = {"group": "g", "gpus": 1, "batch": 1, "seq": 1, "note": ""}
    assert print_published([{**result, "rows": [ours, row("pub", 1.0, fits=False, source="x")]}])
    assert not print_published([{**result, "rows": [ours, row("pub", 1.0, fits=True, source="x")]}])
    assert not print_published([{"group": "g", "error": "killed"}])
    capsys.readouterr()
