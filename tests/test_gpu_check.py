"""``ds-tree gpu-check --smoke``: the GPU check's own code at toy sizes on the CPU, so that it cannot rot
unseen, and a wrong engine fails it (docs/KERNEL.md, "gpu-check")."""

from __future__ import annotations

import json

import pytest
import torch

from ds_tree.attention import registry
from ds_tree.cli.gpu_check import main
from ds_tree.gpu_check import attention
from ds_tree.gpu_check.report import acceptance, markdown


@pytest.mark.slow
def test_smoke_run_writes_every_section_and_passes(tmp_path, capsys) -> None:
    code = main(["--smoke", "--sections", "correctness,kernels,steps", "--output", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 0, report
    assert report["passed"] and report["smoke"]
    correctness = report["sections"]["correctness"]
    ran = {(r["engine"], r["dtype"]) for r in correctness["results"] if r["ran"]}
    assert {("torch", "float32"), ("triton", "float32"), ("flex", "float32"), ("triton", "bfloat16")} <= ran
    assert {("triton list", "float32"), ("triton list", "bfloat16")} <= ran  # the list tile schedule
    assert all(r["passed"] for r in correctness["results"] if r["ran"])
    backward = {r["engine"] for r in correctness["results"] if r.get("checked") == "forward+backward"}
    assert backward == {"torch", "triton", "triton list"}  # flex has no backward on the CPU, varlen no CPU kernel
    kernels = report["sections"]["kernels"]
    assert len(kernels["shapes"]) == 4  # random, GRPO, tiny nodes, a long row
    for shape in kernels["shapes"].values():
        engines = shape["engines"]
        assert all(engines[name]["ran"] for name in ("triton tree", "triton list tree", "sdpa padded flat"))
        assert "triton list tree tuned" not in engines  # autotune: a GPU only
        assert shape["flat_tokens"] > shape["tree_tokens"]
    assert kernels["autotune"] == {"skipped": "autotune runs on a CUDA GPU only"}
    cases = report["sections"]["steps"]["cases"]
    assert [c["ran"] for c in cases] == [True, True]
    assert all(c["speedup"] > 0 and c["ideal_tokens"] > 1 for c in cases)
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "## Correctness against the float64 reference" in markdown and "## Kernel table" in markdown


@pytest.mark.parametrize("engine", ["torch", "triton"])
def test_a_wrong_engine_fails_the_check(tmp_path, monkeypatch, engine) -> None:
    """One key of one query head's output shifted: the correctness section names the engine, exit 1."""
    spec = registry.attention_engine(engine)
    right = spec.function

    def wrong(query, key, value, kv_end, scale=None, **options):
        out = right(query, key, value, kv_end, scale, **options)
        return out + torch.where(torch.arange(out.shape[1], device=out.device) == 3, 1e-3, 0.0)[None, :, None, None]

    monkeypatch.setitem(vars(spec), "function", wrong)  # the engine's loaded function (a cached property)
    first = attention.correctness_cases(True)[:1]
    monkeypatch.setattr(attention, "correctness_cases", lambda smoke: first)
    code = main(["--smoke", "--sections", "correctness", "--output", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert code == 1 and not report["passed"]
    failed = report["sections"]["correctness"]["failed"]
    assert failed and all(name.startswith(engine) for name in failed), failed


def test_usage_errors(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as raised:
        main(["--smoke", "--sections", "kernels,bogus", "--output", str(tmp_path)])
    assert raised.value.code == 2 and "bogus" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as raised:
            main(["--output", str(tmp_path)])
        assert raised.value.code == 2 and "--smoke" in capsys.readouterr().err


def test_issue_46_acceptance_and_autotune_lines() -> None:
    """The best Triton tree column is held against flex on every shape and against 300 TFLOP/s on the GRPO
    and agent shapes; each autotune record gets a line in the report."""

    def ran(tflops: float) -> dict:
        return {"ran": True, "ms": 1.0, "useful_tflops": tflops}

    shapes = {
        "GRPO: one": {"triton tree": ran(100.0), "triton list tree tuned": ran(320.0), "flex tree": ran(220.0)},
        "agent: two": {"triton tree": ran(250.0), "triton list tree": ran(290.0), "flex tree": ran(310.0)},
        "tiny nodes": {"triton tree": ran(20.0), "triton list tree": {"ran": False, "error": "x"}, "flex": ran(9.0)},
    }
    table = {
        name: {"tree_tokens": 8, "flat_tokens": 16, "flat_over_tree_pairs": 1.5, "engines": engines}
        for name, engines in shapes.items()
    }
    record = {
        "key": (128, "bfloat16", 16384, "list"),
        "winner": {"forward": (128, 64), "backward": (64, 64), "num_warps": 8, "num_stages": 3},
        "timings": [{"config": {}, "ms": 2.0}, {"config": {}, "error": "OutOfResources"}, {"config": {}, "ms": 3.0}],
    }
    section = {"dtype": "bfloat16", "heads": 32, "kv_heads": 8, "head_dim": 128, "shapes": table}
    section |= {"flex_compile_s_per_bucket": {}, "autotune": {"search_space": [], "tuned": [record]}}
    report = {"smoke": False, "environment": {}, "sections": {"kernels": section}}
    found = acceptance(report)
    assert found == {
        "issue 46: best triton tree >= flex tree: GRPO: one": True,
        "issue 46: best triton tree >= 300 TFLOP/s: GRPO: one": True,
        "issue 46: best triton tree >= flex tree: agent: two": False,
        "issue 46: best triton tree >= 300 TFLOP/s: agent: two": False,
    }
    report |= {"passed": True, "acceptance": found}
    text = markdown(report)
    assert "- autotune (128, 'bfloat16', 16384, 'list')" in text and "2 ms of 3 candidates (3 ms the slowest)" in text
    assert "- NO: issue 46: best triton tree >= flex tree: agent: two" in text


def test_autotune_is_imported_by_the_gpu_kernel_table_only() -> None:
    """The GPU-only autotune module stays off the CPU path: gpu-check's kernel table is its one importer
    (there, only when the device is CUDA: the smoke run above reports it skipped)."""
    from tests.test_layering import import_graph

    importers = {name for name, targets in import_graph().items() if "ds_tree.kernel.autotune" in targets}
    assert importers == {"ds_tree.gpu_check.attention"}


def test_hybrid_section_is_skipped_on_the_cpu_and_its_table_renders(tmp_path) -> None:
    """The fla section runs on CUDA only (tests/test_fla_scan.py runs the kernels under the interpreter);
    its markdown table, which only a GPU run fills, renders from a report of that shape."""
    assert main(["--smoke", "--sections", "hybrid", "--output", str(tmp_path)]) == 0
    section = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]["hybrid"]
    assert section["passed"] and "CUDA only" in section["skipped"]
    row = {"model": "tiny_bamba", "fla tree against": "torch tree", "loss_rel": 1e-7, "grad_rel_max": 3e-6}
    hybrid = {"tolerance": 1e-5, "correctness": [row | {"logprob_abs_max": 2e-6, "passed": True}]}
    hybrid["timing"] = [{"kernels": "torch", "tree_tokens": 16001, "step_s": 2.5}]
    hybrid["timing"].append({"kernels": "fla", "tree_tokens": 16001, "step_s": 0.25})
    report = {"smoke": False, "environment": {}, "sections": {"hybrid": hybrid | {"passed": True}}}
    report |= {"passed": True, "acceptance": acceptance(report)}
    assert list(report["acceptance"].values()) == [True, True]
    text = markdown(report)
    assert "| tiny_bamba | torch tree | 1e-07 | 3e-06 | 2e-06 | True |" in text and "| fla | 16001 | 0.25 |" in text
