"""`loomrl bench attention` runs both arms on the demo's shape and reports their medians and ratio."""

import json

import pytest
import torch

from loomrl.commands import bench_attention


def test_bench_attention_reports_both_forwards(capsys):
    pytest.importorskip("vllm")
    from loomrl.platform.backbone import vllm_kernels

    if vllm_kernels.attention_isa(32) is None:
        pytest.skip("vLLM's CPU attention kernel does not load here")
    threads = torch.get_num_threads()
    try:
        assert bench_attention.main(["--shapes", "demo", "--rounds", "2", "--json"]) == 0
    finally:
        torch.set_num_threads(threads)
    (result,) = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["shape"] == "demo" and result["isa"] == vllm_kernels.attention_isa(32)
    for name in ("no_grad", "forward_backward"):
        m = result[name]
        assert m["kernel_ms"] > 0 and m["torch_ms"] > 0
        assert m["torch_over_kernel"] == pytest.approx(m["torch_ms"] / m["kernel_ms"], rel=1e-2)


def test_bench_attention_refuses_an_unknown_shape(capsys):
    assert bench_attention.main(["--shapes", "qwen9"]) == 2
    assert "qwen9" in capsys.readouterr().err
