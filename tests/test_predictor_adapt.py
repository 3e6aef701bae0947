"""``fleetbatch predictor adapt``: observed lengths of a more verbose served model, written to a real Redis the way
the engines write them, and ``fleetbatch predictor retrain --redis-url`` moving predictions toward them."""

from __future__ import annotations

import json

import numpy as np
import redis
import torch

from predictor.adapt import served_name, split_observed, trained_alpaca_models
from predictor.cli import main
from predictor.labeled import LabeledSet
from predictor.observed import OBSERVED_KEY
from tests.predictor_fixtures import save_small_tokenizer, synthetic, write_jsonl

torch.set_num_threads(1)

TINY = ["--layers", "1", "--dim", "32", "--heads", "2", "--max-len", "32", "--vocab", "300"]


def test_retrain_from_redis_moves_predictions_toward_observed_lengths(tmp_path, redis_url, capsys):
    tok = tmp_path / "tok"
    save_small_tokenizer(tok)
    original = write_jsonl(synthetic(300), tmp_path / "original.jsonl")
    s = synthetic(240, seed=3)  # the served model answers the same kinds of prompt 3x as long
    served = LabeledSet([f"served {p}" for p in s.prompts], s.lengths * 3, s.sources)
    served_file = write_jsonl(served, tmp_path / "served.jsonl")
    common = ["--dataset", str(original), "--served-model", str(tok), "--threads", "1"]
    model = tmp_path / "model"
    train = ["train", *common, "--out", str(model), "--epochs", "4", "--buckets", "6", "--lr", "1e-2"]
    assert main([*train, "--patience", "10", "--ema", "0", *TINY]) == 0
    capsys.readouterr()

    adapt = [
        "adapt",
        *common,
        "--predictor",
        str(model),
        "--served",
        str(served_file),
        "--redis-url",
        redis_url,
    ]
    adapt += ["--relabel-original", "0", "--original", "0", "--epochs", "6", "--lr", "1e-2", "--seed", "1"]
    assert main(adapt) == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    assert any(line.startswith("served held-out") for line in out[:-1])  # the table comes first
    assert r["observed"] + r["held_out"] == len(served) and r["observed"] == len(served) // 2
    assert r["retrain"]["observed_examples"] == r["observed"]
    assert r["sum_ratio_before"] < 0.6  # the old model expects the short answers it was trained on
    assert abs(r["sum_ratio_after"] - 1) < abs(r["sum_ratio_before"] - 1) - 0.2
    assert r["mae_after"] < r["mae_before"]

    # the observations went through WorkQueue.record_observed, in the worker's record format
    rows = [json.loads(x) for x in redis.Redis.from_url(redis_url).lrange(OBSERVED_KEY, 0, -1)]
    assert len(rows) == r["observed"]
    assert set(rows[0]) == {"prompt", "length", "source", "cluster", "predicted"}
    truth = dict(zip(served.prompts, served.lengths.tolist(), strict=True))
    assert all(truth[x["prompt"]] == x["length"] and x["predicted"] > 0 for x in rows)


def test_observed_split_and_training_models():
    data = LabeledSet([f"p{i % 50}" for i in range(60)], np.arange(60), ["s"] * 60)  # 10 duplicates
    obs, held = split_observed(data, 0.5, seed=4)
    assert not set(obs.prompts) & set(held.prompts) and len(obs) + len(held) == 60
    again, _ = split_observed(data, 0.5, seed=4)
    assert again.prompts == obs.prompts
    assert served_name("gpt4_0613") == "alpaca_eval:gpt4_0613"
    assert trained_alpaca_models({"data": "mixed", "extra_train": "alpaca_eval:gpt4_0613,gsm8k_test"}) == {
        "llama-2-7b-chat-hf",
        "gpt4_0613",
    }
    assert trained_alpaca_models({"data": "x.jsonl"}) == set()
