"""Language models trained federatedly, end to end: the built-in character transformer and a small
transformers model learn next characters from the Shakespeare roles (the real play texts where
FEDSIM_DATA has them, generated plays otherwise), LoRA adapters fine-tune a trained base further,
the numbers do not depend on the workers or on a resume, and the workers share one base."""

import math
import os
import random
from pathlib import Path

import pytest
import torch
from test_text_data import write_play

import fedsim
from fedsim.data import load_dataset

pytestmark = pytest.mark.slow

SEQUENCE = 64
TINY = {"layers": 2, "width": 64, "heads": 4}
# the quick CPU version llm/shakespeare_char's header shows, and its LoRA counterpart
QUICK = {
    "data.num_clients": 200,
    "data.sequence_length": SEQUENCE,
    "model_options.layers": 2,
    "model_options.width": 64,
    "rounds": 30,
    "local.steps": 10,
    "local.epochs": 2,
    "eval_every": 10,
}
QUICK_LORA = {**{k: v for k, v in QUICK.items() if k != "rounds"}, "rounds": 6, "eval_every": 3}
BASE_RUN = {
    "seed": 0,
    "device": "cpu",
    "model": "char_transformer",
    "model_options": TINY,
    "clients_per_round": 10,
    "eval_every": 100,  # the last round only: the runs compare their final scores
    "eval_batch_size": 512,
    "data": {"dataset": "shakespeare_text", "partition": "natural", "num_clients": 200, "sequence_length": SEQUENCE},
    "local": {"optimizer": "adamw", "lr": 3e-3, "batch_size": 16, "epochs": 2, "steps": 10},
}


def generated_plays(root: Path) -> Path:
    """Plays in the real texts' layout whose verse has structure to learn: 240 roles speaking
    lines drawn from a small grammar."""
    rng = random.Random(0)
    nouns, verbs = ["lord", "king", "crown", "sword", "night", "heart"], ["loves", "fears", "keeps", "seeks"]
    for play in range(8):
        speeches = []
        for role in range(30):
            line = lambda: f"The {rng.choice(nouns)} {rng.choice(verbs)} the {rng.choice(nouns)}."  # noqa: E731
            speeches.append((f"Lord{chr(65 + role % 26)}{role}", [line() for _ in range(40)]))
        write_play(root / "shakespeare" / "texts", f"THE PLAY {chr(65 + play)}", speeches)
    return root


@pytest.fixture(scope="module")
def text_root(tmp_path_factory) -> Path:
    real = os.environ.get("FEDSIM_DATA")
    if real and (Path(real) / "shakespeare" / "texts").is_dir():
        return Path(real)
    return generated_plays(tmp_path_factory.mktemp("plays"))


def unigram_loss(root: Path) -> float:
    """The test loss of predicting every character by its training frequency: the baseline a
    model must beat to have learnt anything from context."""
    data = load_dataset("shakespeare_text", root, sequence_length=SEQUENCE)
    counts = torch.bincount(data.train_y[data.train_y >= 0], minlength=data.num_classes).double()
    probabilities = counts / counts.sum()
    test = data.test_y[data.test_y >= 0]
    return float(-probabilities.clamp_min(1e-12).log()[test].mean())


def run(root: Path, out: Path, **changes) -> fedsim.results.History:
    config = {**BASE_RUN, **changes, "data": {**BASE_RUN["data"], "root": str(root)}}
    return fedsim.run(config, out=out, quiet=True)


def shipped(name: str, root: Path, out: Path, **overrides) -> fedsim.results.History:
    return fedsim.run(name, out=out, quiet=True, **{"data.root": str(root), "device": "cpu", **overrides})


def test_the_quick_version_is_the_one_the_experiment_file_shows():
    header = (Path(fedsim.__file__).parent / "experiments" / "llm" / "shakespeare_char.yaml").read_text()
    for key, value in QUICK.items():
        assert f"--set {key}={value}" in header, key


@pytest.fixture(scope="module")
def trained_base(text_root, tmp_path_factory):
    """llm/shakespeare_char's quick version: the base the LoRA runs fine-tune."""
    return shipped("llm/shakespeare_char", text_root, tmp_path_factory.mktemp("base") / "run", workers=2, **QUICK)


def test_char_transformer_learns_next_characters_well_below_the_unigram_baseline(text_root, trained_base):
    baseline = unigram_loss(text_root)
    loss = trained_base.test_loss[-1]
    assert loss < baseline - 0.4, (loss, baseline)  # real plays: 3.10 -> about 2.4
    assert trained_base.test_perplexity[-1] == pytest.approx(math.exp(loss), rel=1e-12)
    assert trained_base.summary["best_test_perplexity"] <= trained_base.summary["final_test_perplexity"]


def test_lora_fine_tunes_the_trained_base_further_whatever_the_workers_and_a_resume(text_root, trained_base, tmp_path):
    lora = {"initial_weights": str(trained_base.run_dir), **QUICK_LORA}
    one = shipped("llm/shakespeare_lora", text_root, tmp_path / "one", workers=1, **lora)
    start = trained_base.test_loss[-1]
    assert one.test_loss[-1] < start - 0.01 < unigram_loss(text_root) - 0.4, (one.test_loss, start)  # deterministic
    # only the adapters travel: the checkpoint holds them, the frozen base is the summary's own figure
    adapters = 2 * 8 * ((64 + 3 * 64) + (64 + 4 * 64))  # 2 layers, A (r x in) and B (out x r) of c_attn, c_fc
    assert torch.load(one.run_dir / "checkpoint.pt", weights_only=True)["global"].numel() == adapters
    assert one.summary["frozen_base_mb"] > 0
    # 2 workers to round 3, stopped, resumed to round 6 by 1 worker: the numbers of 1 worker throughout
    # (round 0 trained nothing: NaN), but round 3, the last of the stopped run, was scored on the
    # whole test set, not eval_subset's 512
    shipped("llm/shakespeare_lora", text_root, tmp_path / "resumed", workers=2, **{**lora, "rounds": 3})
    resumed = fedsim.resume(tmp_path / "resumed", rounds=6, workers=1, quiet=True)
    assert resumed.test_loss[-1] == one.test_loss[-1] and resumed.train_loss[1:] == one.train_loss[1:]
    whole = one.test_samples[-1]  # round 0, the base before fine-tuning, is scored on the whole set too
    assert one.test_samples == [whole, min(512, whole), whole] and resumed.test_samples == [whole, whole, whole]
    assert one.round[0] == 0 and one.test_loss[0] == pytest.approx(start, rel=1e-6)  # the base, as its run scored it


def test_ffa_lora_trains_only_b_and_learns(text_root, trained_base, tmp_path):
    lora = {"initial_weights": str(trained_base.run_dir), **QUICK_LORA, "lora.method": "ffa"}
    ffa = shipped("llm/shakespeare_lora", text_root, tmp_path / "ffa", workers=2, **lora)
    assert ffa.test_loss[-1] < trained_base.test_loss[-1] - 0.01, (ffa.test_loss, trained_base.test_loss)
    b_only = 2 * 8 * (3 * 64 + 4 * 64)  # 2 layers, B (out x r) of c_attn and c_fc
    assert torch.load(ffa.run_dir / "checkpoint.pt", weights_only=True)["global"].numel() == b_only


@pytest.mark.parametrize("method", ["hetlora", "flora"])
def test_the_heterogeneous_rank_files_fine_tune_the_base_further(text_root, trained_base, tmp_path, method):
    """llm/shakespeare_hetlora and llm/shakespeare_flora, as their headers' quick versions run them."""
    lora = {"initial_weights": str(trained_base.run_dir), **QUICK_LORA}
    run = shipped(f"llm/shakespeare_{method}", text_root, tmp_path / method, workers=2, **lora)
    assert run.test_loss[-1] < trained_base.test_loss[-1] - 0.005, (run.test_loss, trained_base.test_loss)
    assert {r["lora_rank"] for r in run.client_records} <= {1, 2, 3, 4, 7, 8}  # 2, 4, 8, or pruned by 0.9
    assert run.summary["lora"]["client_ranks"] == {"choice": [2, 4, 8]}


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    transformers = pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQUENCE,
    ).save_pretrained(folder)
    return folder


def test_a_transformers_model_learns_and_its_lora_adapters_fine_tune_it(text_root, llama_folder, tmp_path):
    model = {"model": f"hf:{llama_folder}", "model_options": {}}
    base = run(text_root, tmp_path / "base", workers=2, rounds=15, **model)
    baseline = unigram_loss(text_root)
    assert base.test_loss[-1] < baseline - 0.3, (base.test_loss, baseline)
    lora = {"rank": 8}  # peft's default layers for Llama: q_proj and v_proj
    tuned = run(
        text_root, tmp_path / "lora", workers=2, rounds=4, initial_weights=str(base.run_dir), lora=lora, **model
    )
    assert tuned.test_loss[-1] < base.test_loss[-1], (tuned.test_loss, base.test_loss)
    adapters = 2 * 2 * 8 * (64 + 64)  # 2 layers x (q_proj, v_proj) x r x (in + out)
    assert torch.load(tuned.run_dir / "checkpoint.pt", weights_only=True)["global"].numel() == adapters


def test_workers_share_one_frozen_base_where_peers_hold_a_copy_each(tmp_path):
    """Proportional set sizes (Linux): with the base shared, the workers' share of it is what the
    three processes split; with a copy per worker, each holds a whole base more."""
    if not Path("/proc/self/smaps_rollup").exists():
        pytest.skip("proportional set sizes are read from /proc (Linux)")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (400, 33), generator=g)
    data = fedsim.data.Dataset(ids[:320, :-1], ids[:320, 1:], ids[320:, :-1], ids[320:, 1:], 256, name="tokens")
    cfg = {
        "device": "cpu",
        "rounds": 1,
        "clients_per_round": 2,
        "workers": 2,
        "model": "char_transformer",
        "model_options": {"layers": 6, "width": 768, "heads": 12},  # 42.7 M frozen parameters: a 163 MB base
        "lora": {"rank": 4},
        "data": {"dataset": data, "num_clients": 2},
        "local": {"optimizer": "adamw", "lr": 1e-3, "batch_size": 8, "steps": 1},
    }
    shared = fedsim.run(cfg, out=tmp_path / "shared", quiet=True)
    copied = fedsim.run({**cfg, "lora": {"rank": 4, "share_base": False}}, out=tmp_path / "copied", quiet=True)
    base = shared.summary["frozen_base_mb"]
    assert base == copied.summary["frozen_base_mb"] and base > 160
    # a copy each costs the 2 workers 2 bases more; the rest of a worker's memory moves by tens of
    # MB from run to run, so more than 1.2 bases saved is what sharing alone explains. The server
    # is this test's own process, whose memory holds what earlier tests left: its PSS (read with
    # the workers', at one moment) is in the total, but not compared between the two runs
    sizes = [
        {k: run.summary[k] for k in ("worker_pss_mb", "server_pss_mb", "total_pss_mb")} for run in (shared, copied)
    ]
    for summary in sizes:
        total = sum(summary["worker_pss_mb"]) + summary["server_pss_mb"]
        assert summary["total_pss_mb"] == pytest.approx(total, abs=0.2)
    saved = sum(copied.summary["worker_pss_mb"]) - sum(shared.summary["worker_pss_mb"])
    assert saved > 1.2 * base, (sizes, base)
    assert shared.test_loss == copied.test_loss  # where the base lives changes no number
