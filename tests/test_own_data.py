"""Data as a user has it, through the CLI, with no `shards make` and no converter: SFT on a LLaVA
JSON list of multi-turn conversations (photos by path; every assistant turn trained), named as
`data.source`, then `loomrl export`, then GRPO with a verifiable reward on a verl-style parquet file
(the prompt as chat messages, the image bytes in a column, the answer under
`reward_model.ground_truth`), then the export of that, which transformers loads with the trainer's
logits. The shards of each source are made once into `data.cache` and reused by the next run."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
from qwen_checkpoints import CHAT_TEMPLATE, _qwen2_vl
from test_own_task import PHOTOS, VAL_QUESTION, WORDS, _photos, _recipe, _run, _val, check_export


def _conversations(photo: str) -> list[dict]:
    return [
        {"from": "human", "value": "<image>\nwhat is in the picture ?"},
        {"from": "gpt", "value": photo},
        {"from": "human", "value": "name this picture ?"},
        {"from": "gpt", "value": photo},
    ]


def _verl_parquet(path, folder):
    rows = [
        {
            "data_source": "photos",
            "prompt": [{"role": "user", "content": "<image>what is this ?"}],
            "images": [{"bytes": (folder / f"{p}.png").read_bytes(), "path": None}],
            "reward_model": {"style": "rule", "ground_truth": p},
            "extra_info": {"index": i},
        }
        for i, p in enumerate(PHOTOS)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_sft_from_a_llava_json_then_grpo_from_a_verl_parquet(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _qwen2_vl(str(tmp_path / "base"), words=WORDS, chat_template=CHAT_TEMPLATE)
    _photos(tmp_path / "img")
    llava = [
        {"id": f"{p}-{k}", "image": f"img/{p}.png", "conversations": _conversations(p)} for p in PHOTOS for k in (0, 1)
    ]
    (tmp_path / "train.json").write_text(json.dumps(llava))
    val = [
        {
            "id": p,
            "image": f"img/{p}.png",
            "conversations": [{"from": "human", "value": VAL_QUESTION}, {"from": "gpt", "value": p}],
        }
        for p in PHOTOS
    ]
    (tmp_path / "val.json").write_text(json.dumps(val))
    common = """
validation: {source: val.json, every: 10, samples: 4, max_new_tokens: 3}
logging: {tensorboard: false, progress: false}
"""
    sft = _recipe(
        tmp_path / "sft.yaml",
        f"""
name: sft
model: {{init_from: base}}
data: {{source: train.json, shuffle_buffer: 8}}
algorithm: {{name: sft, reward: exact}}
training: {{steps: 30, prompts_per_step: 8, micro_batch_size: 8, lr: 0.003, threads: 1}}
rollout: {{max_new_tokens: 3}}
{common}""",
    )
    _run(["run", sft, "--dry-run"])  # makes the shards of both sources, once
    out = capsys.readouterr().out
    assert "making shards of train.json" in out and "making shards of val.json" in out
    made = sorted(p.name for p in (tmp_path / "data/cache").iterdir())
    assert len(made) == 2 and all(not name.startswith(".") for name in made), made  # no half-made folder left
    info = json.loads(next((tmp_path / "data/cache").glob("train-*/made.json")).read_text())
    assert (info["written"], info["rejected"], info["layouts"]) == (8, 0, {"llava": 8})

    _run(["run", sft, "--out", "runs/sft"])
    assert "shards made before" in capsys.readouterr().out  # the dry run's shards, reused
    rows = [json.loads(x) for x in (tmp_path / "runs/sft/metrics.jsonl").read_text().splitlines()]
    # both assistant turns are trained: the first reply (+ its end-of-turn) and the answer (+ its)
    assert all(r["answer_tokens"] == 8 * 4 for r in rows), [r["answer_tokens"] for r in rows]
    assert rows[-1]["loss"] < rows[0]["loss"] / 4
    sval = _val(tmp_path / "runs/sft")
    assert sval[0]["val_reward_mean"] <= 0.25 and sval[-1]["val_reward_mean"] >= 0.75, sval
    _run(["export", "runs/sft/checkpoints/step-000030", "--out", "sft-hf"])

    _verl_parquet(tmp_path / "train.parquet", tmp_path / "img")
    grpo = _recipe(
        tmp_path / "grpo.yaml",
        f"""
name: grpo
model: {{init_from: sft-hf}}
data: {{source: train.parquet, shuffle_buffer: 4}}
algorithm: {{name: grpo, reward: exact}}
training: {{steps: 2, prompts_per_step: 4, micro_batch_size: 16, lr: 0.0001, threads: 1}}
rollout: {{n: 4, max_new_tokens: 3}}
{common.replace("every: 10", "every: 2")}""",
    )
    _run(["run", grpo, "--out", "runs/grpo"])
    made = [json.loads(p.read_text()) for p in (tmp_path / "data/cache").glob("train-*/made.json")]
    (parquet,) = [m for m in made if m["source"].endswith("train.parquet")]
    assert (parquet["written"], parquet["layouts"]) == (4, {"verl": 4})
    gval = _val(tmp_path / "runs/grpo")
    assert gval[0]["val_reward_mean"] == sval[-1]["val_reward_mean"]  # the export carried the SFT policy
    grows = [json.loads(x) for x in (tmp_path / "runs/grpo/metrics.jsonl").read_text().splitlines()]
    assert len(grows) == 2 and all(0.0 <= r["reward_mean"] <= 1.0 for r in grows)
    _run(["export", "runs/grpo/checkpoints/step-000002", "--out", "final-hf"])
    check_export(tmp_path, "runs/grpo", "step-000002", "final-hf")
