"""Loading run directories and tabulating them (on fabricated run directories, no training)."""

from __future__ import annotations

import importlib
import json
import math

import pytest
from support import write_run

import fedsim
from fedsim.core.errors import FedsimError
from fedsim.results.history import History, group_repeats, mean_and_sd, rounds_to_target
from fedsim.results.table import results_table


def test_load_run_reads_metrics_config_and_summary(tmp_path):
    write_run(
        tmp_path / "a",
        name="alpha",
        seed=4,
        accuracies=(0.25, 0.5),
        settings={"aggregator": "median", "data.alpha": 0.3},
    )
    h = fedsim.load_run(tmp_path / "a")

    assert h.round == [1, 2] and isinstance(h.round[0], int)
    assert h.test_accuracy == [0.25, 0.5] and h.elapsed_seconds == [5.5, 7.0]
    assert h.rows[0]["clients"] == 4
    assert h.name == "alpha" and h.config["seed"] == 4 and h.summary["wall_seconds"] == 7.0
    assert h.run_dir == tmp_path / "a"
    assert h.final_accuracy == 0.5 and h.best_accuracy == 0.5 and len(h) == 2
    assert h.config_value("aggregator") == "median" and h.config_value("data.alpha") == 0.3
    assert h.config_value("name") == "alpha"


def test_load_run_without_summary_or_config(tmp_path):
    write_run(tmp_path / "running", summary=False)
    (tmp_path / "running" / "config.yaml").unlink()
    h = fedsim.load_run(tmp_path / "running")
    assert h.summary == {} and h.config == {} and h.name == "running" and len(h) == 3


def test_load_run_reads_metrics_with_fewer_columns(tmp_path):
    # a run directory written before the per-phase timing columns existed
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.csv").write_text(
        "round,test_accuracy,test_loss,train_loss,seconds,elapsed_seconds,clients,dropped_clients,attackers\n"
        "1,0.5,1.5,1.6,2.0,2.0,4,0,0\n"
    )
    h = fedsim.load_run(tmp_path / "old")
    assert h.test_accuracy == [0.5] and h.elapsed_seconds == [2.0]


@pytest.mark.parametrize(
    "make, message",
    [(lambda p: None, "no such run directory"), (lambda p: p.mkdir(), "not a run directory (no metrics.csv)")],
)
def test_load_run_of_a_non_run_directory_says_so_in_one_line(tmp_path, make, message):
    make(tmp_path / "x")
    with pytest.raises(FedsimError) as e:
        fedsim.load_run(tmp_path / "x")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_load_run_names_a_broken_file(tmp_path):
    run = write_run(tmp_path / "a")
    (run / "config.yaml").write_text("name: [unclosed\n")
    with pytest.raises(FedsimError, match="config.yaml: cannot read") as e:
        fedsim.load_run(run)
    assert "\n" not in str(e.value)

    run = write_run(tmp_path / "b")
    with open(run / "metrics.csv", "a") as f:
        f.write("4,0.9\n")  # a row cut short
    with pytest.raises(FedsimError, match=r"metrics.csv: line 5: not a complete metrics row"):
        fedsim.load_run(run)


def test_load_runs_matches_a_pattern_sorted_and_skips_other_folders(tmp_path):
    for name in ("cmp-b", "cmp-a", "other"):
        write_run(tmp_path / name, name=name)
    (tmp_path / "cmp-empty").mkdir()
    histories = fedsim.load_runs(tmp_path / "cmp-*")
    assert [h.name for h in histories] == ["cmp-a", "cmp-b"]

    with pytest.raises(FedsimError, match="no run directory") as e:
        fedsim.load_runs(tmp_path / "nothing-*")
    assert "\n" not in str(e.value)


def test_config_value_of_a_missing_key():
    with pytest.raises(FedsimError, match="data.nope: not a config key of run 'r'"):
        History([], {"name": "r", "data": {}}).config_value("data.nope")


def histories_of(tmp_path, specs):
    return [fedsim.load_run(write_run(tmp_path / f"run{i}", **spec)) for i, spec in enumerate(specs)]


def test_runs_that_differ_only_in_seed_and_run_specific_keys_are_grouped(tmp_path):
    runs = histories_of(
        tmp_path,
        [
            {"name": "a", "seed": 0},
            {"name": "b", "seed": 1, "settings": {"workers": 4}},
            {"name": "c", "seed": 0, "settings": {"aggregator": "median"}},
            {"name": "d", "seed": 2, "settings": {"data.root": "/elsewhere"}},
        ],
    )
    assert [[h.name for h in g] for g in group_repeats(runs)] == [["a", "b", "d"], ["c"]]
    assert len(group_repeats(runs, distinguish=("seed",))) == 4
    assert len(group_repeats(runs, distinguish=("name",))) == 4
    assert len(group_repeats([History([{"round": 1}]), History([{"round": 1}])])) == 2  # no config: never pooled


def test_a_run_recorded_before_a_key_with_a_null_default_was_added_repeats_one_with_it():
    older = History([{"round": 1}], {"seed": 0, "data": {"dataset": "mnist"}})
    newer = History([{"round": 1}], {"seed": 1, "data": {"dataset": "mnist", "seed": None}})
    fixed = History([{"round": 1}], {"seed": 2, "data": {"dataset": "mnist", "seed": 0}})
    assert group_repeats([older, newer, fixed]) == [[older, newer], [fixed]]


def test_results_table_pools_seeds_and_prints_markdown(tmp_path):
    runs = histories_of(
        tmp_path,
        [
            {"name": "fedavg", "seed": 0, "accuracies": (0.5, 0.8)},
            {"name": "fedavg", "seed": 1, "accuracies": (0.6, 0.9)},
            {"name": "median", "seed": 0, "accuracies": (0.4, 0.7), "settings": {"aggregator": "median"}},
        ],
    )
    table = results_table(runs, keys=("name", "aggregator"))
    assert [row["name"] for row in table] == ["fedavg", "median"]
    first = table[0]
    assert first["runs"] == 2 and first["final_accuracy"] == pytest.approx(0.85)
    assert first["final_accuracy_std"] == pytest.approx(0.0707, abs=1e-4)
    assert first["best_accuracy"] == pytest.approx(0.85) and first["rounds"] == 2
    assert first["wall_seconds"] == pytest.approx(3.5)  # the mean of 3.0 and 4.0

    lines = table.markdown().splitlines()
    assert lines[0] == "| name | aggregator | runs | final acc. (%) | best acc. (%) | rounds | wall (s) |"
    assert lines[1] == "|---|---|---:|---:|---:|---:|---:|"
    assert lines[2] == "| fedavg | fedavg | 2 | 85.0 ± 7.1 | 85.0 | 2 | 3.5 |"
    assert lines[3] == "| median | median | 1 | 70.0 | 70.0 | 2 | 3.0 |"
    assert str(table) == repr(table) == table._repr_markdown_() == table.markdown()


def test_results_table_of_single_runs_has_no_runs_column(tmp_path):
    runs = histories_of(tmp_path, [{"name": "a"}, {"name": "b", "seed": 1}])
    assert (
        fedsim.results_table(runs).markdown().splitlines()[0]
        == "| name | final acc. (%) | best acc. (%) | rounds | wall (s) |"
    )


def test_results_table_escapes_markdown_in_values(tmp_path):
    run = fedsim.load_run(
        write_run(tmp_path / "run", name="mine", accuracies=(0.5,), settings={"aggregator": "__main__:my|rule"})
    )
    table = fedsim.results_table([run], keys=("aggregator",)).markdown()
    assert "\\_\\_main\\_\\_:my\\|rule" in table.splitlines()[2]


def test_rounds_to_target_is_the_first_evaluated_round_at_or_above_it():
    rows = [{"round": r, "test_accuracy": a} for r, a in [(2, 0.5), (4, float("nan")), (6, 0.9), (8, 0.95)]]
    history = History(rows)
    assert rounds_to_target(history, 0.9) == 6  # evaluated every 2 rounds: the round number, not the row
    assert rounds_to_target(history, 0.5) == 2 and rounds_to_target(history, 0.96) is None


def test_results_table_gives_rounds_to_target_over_the_seeds_that_reached_it(tmp_path):
    runs = histories_of(
        tmp_path,
        [
            {"name": "fedavg", "seed": 0, "accuracies": (0.5, 0.8, 0.9, 0.95)},
            {"name": "fedavg", "seed": 1, "accuracies": (0.6, 0.9, 0.92, 0.93)},
            {"name": "fedavg", "seed": 2, "accuracies": (0.5, 0.6, 0.7, 0.8)},
            {"name": "fedavg", "seed": 3, "accuracies": (0.9, 0.9, 0.9, 0.9)},
            {"name": "median", "seed": 0, "accuracies": (0.4, 0.7), "settings": {"aggregator": "median"}},
            {"name": "median", "seed": 1, "accuracies": (0.4, 0.6), "settings": {"aggregator": "median"}},
        ],
    )
    table = results_table(runs, keys=("aggregator",), target=0.9)
    fedavg, median = table
    reached = [3, 2, 1]  # seed 2 never gets to 0.9
    mean = sum(reached) / 3
    sd = (sum((r - mean) ** 2 for r in reached) / 2) ** 0.5
    assert (fedavg["target"], fedavg["reached"], fedavg["runs"]) == (0.9, 3, 4)
    assert fedavg["rounds_to_target"] == pytest.approx(mean) and fedavg["rounds_to_target_std"] == pytest.approx(sd)
    assert median["reached"] == 0 and math.isnan(median["rounds_to_target"])

    lines = table.markdown().splitlines()
    assert lines[0] == ("| aggregator | runs | final acc. (%) | best acc. (%) | rounds to 90 % | rounds | wall (s) |")
    assert lines[2].split(" | ")[4] == f"{mean:.1f} ± {sd:.1f} (3/4)" == "2.0 ± 1.0 (3/4)"
    assert lines[3].split(" | ")[4] == "– (0/2)"

    one = histories_of(
        tmp_path / "one", [{"name": "a", "accuracies": (0.5, 0.95)}, {"name": "b", "accuracies": (0.5,)}]
    )
    assert [line.split(" | ")[3] for line in results_table(one, target=0.9).markdown().splitlines()[2:]] == [
        "2",
        "not reached",
    ]


def test_results_table_takes_the_target_from_stop_at_accuracy(tmp_path):
    runs = histories_of(
        tmp_path,
        [
            {"name": "a", "seed": 0, "accuracies": (0.5, 0.99), "settings": {"stop_at_accuracy": 0.99}},
            {"name": "a", "seed": 1, "accuracies": (0.5, 0.7, 0.99), "settings": {"stop_at_accuracy": 0.99}},
            {"name": "b", "accuracies": (0.5, 0.8), "settings": {"stop_at_accuracy": 0.8}},
            {"name": "c", "accuracies": (0.5, 0.8)},
        ],
    )
    table = results_table(runs)
    assert [(row["name"], row["target"], row["rounds_to_target"]) for row in table] == [
        ("a", 0.99, 2.5),
        ("b", 0.8, 2.0),
        ("c", None, None),
    ]
    lines = table.markdown().splitlines()
    assert lines[0] == (
        "| name | runs | final acc. (%) | best acc. (%) | target (%) | rounds to target | rounds | wall (s) |"
    )
    assert [line.split(" | ")[4:6] for line in lines[2:]] == [["99", "2.5 ± 0.7 (2/2)"], ["80", "2"], ["–", "–"]]
    assert "rounds to" not in results_table(runs[3:]).markdown()  # no target anywhere: no column

    with pytest.raises(FedsimError, match="target: must be a test accuracy"):
        results_table(runs, target=99)


# ----------------------------------------------------------------------------- getting results out


def test_a_failed_or_empty_run_is_left_out_with_a_warning(tmp_path, caplog):
    write_run(tmp_path / "runs-a", seed=0, accuracies=(0.5, 0.7))
    write_run(tmp_path / "runs-b", seed=1, accuracies=(0.6, 0.9))
    empty = write_run(tmp_path / "runs-c", seed=2, accuracies=(), summary=False)  # started, no round evaluated yet
    failed = write_run(tmp_path / "runs-d", seed=3, accuracies=(0.1,))
    (failed / "summary.json").write_text('{"status": "failed", "error": "worker 1 failed while starting"}')
    runs = fedsim.load_runs(tmp_path / "runs-*")
    assert [h.run_dir.name for h in runs] == ["runs-a", "runs-b"]
    assert f"{empty}: left out; it has no evaluated round" in caplog.messages
    assert f"{failed}: left out; the run failed (worker 1 failed while starting)" in caplog.messages
    (row,) = results_table([fedsim.load_run(p) for p in (tmp_path / "runs-a", empty, tmp_path / "runs-b")])
    assert row["runs"] == 2 and row["final_accuracy"] == pytest.approx(0.8)  # (0.7 + 0.9) / 2
    assert row["final_accuracy_std"] == pytest.approx(math.sqrt(0.02))  # sample s.d. of 0.7, 0.9
    with pytest.raises(FedsimError, match="every run directory that matches failed or has no evaluated round"):
        fedsim.load_runs(tmp_path / "runs-[cd]")


def test_a_table_takes_run_directories_patterns_and_a_sweep_s_runs_as_plots_do(tmp_path):
    from types import SimpleNamespace

    write_run(tmp_path / "sweep" / "runs-a", seed=0, accuracies=(0.5, 0.7))
    write_run(tmp_path / "sweep" / "runs-b", seed=1, accuracies=(0.6, 0.9))
    expected = results_table(fedsim.load_runs(tmp_path / "sweep" / "*"))
    assert results_table(str(tmp_path / "sweep" / "*")) == expected
    assert results_table([tmp_path / "sweep" / "runs-a", tmp_path / "sweep" / "runs-b"]) == expected
    swept = [SimpleNamespace(history=h) for h in fedsim.load_runs(tmp_path / "sweep" / "*")]  # fedsim.sweep's runs
    assert results_table(swept) == expected and fedsim.plot_runs(swept).axes
    with pytest.raises(FedsimError, match=r'sweep: not a run directory .*give ".*/sweep/\*" for them'):
        results_table(tmp_path / "sweep")
    with pytest.raises(FedsimError, match="^no runs for the table: got int 3; give History objects, a sweep's runs"):
        results_table([3])


def test_two_runs_with_the_same_seed_count_as_one(tmp_path, caplog):
    first = write_run(tmp_path / "first", seed=0, accuracies=(0.5, 0.7))
    again = write_run(tmp_path / "again", seed=0, accuracies=(0.5, 0.7), settings={"workers": 4})
    other = write_run(tmp_path / "other", seed=1, accuracies=(0.6, 0.8))
    (row,) = results_table([fedsim.load_run(p) for p in (first, again, other)])
    assert row["runs"] == 2 and row["final_accuracy_std"] == pytest.approx(math.sqrt(0.005))  # 0.7, 0.8
    assert (
        f"{first} and {again} ran the same experiment with seed 0; counting it once, as {again} (the later of the two)"
        in caplog.messages
    )


def with_status(path, status, rounds):
    """A run directory's summary.json saying how it ended and after how many rounds."""
    (path / "summary.json").write_text(json.dumps({"status": status, "rounds": rounds}))
    return path


def test_a_finished_run_counts_over_an_unfinished_copy_of_its_seed(tmp_path, caplog):
    three = {"rounds": 3}
    done = write_run(tmp_path / "a", seed=0, accuracies=(0.3, 0.5, 0.7), settings=three)
    copy = with_status(write_run(tmp_path / "z_int", seed=0, accuracies=(0.3,), settings=three), "interrupted", 1)
    (group,) = group_repeats([fedsim.load_run(done), fedsim.load_run(copy)])
    assert [h.run_dir for h in group] == [done]
    assert (
        f"{done} and {copy} ran the same experiment with seed 0; counting it once, as {done} (finished; the "
        f"other was interrupted at round 1 of 3)" in caplog.messages
    )
    # two unfinished copies: the one that got further
    further = write_run(tmp_path / "y_int", seed=0, accuracies=(0.3, 0.5), settings=three)
    further = with_status(further, "interrupted", 2)
    (group,) = group_repeats([fedsim.load_run(further), fedsim.load_run(copy)])
    assert [h.run_dir for h in group] == [further]
    assert (
        f"counting it once, as {further} (it has more rounds, 2 against 1; the other was interrupted"
        in (caplog.messages[-1])
    )


def test_an_interrupted_run_is_left_out_beside_finished_ones_and_marked_when_alone(tmp_path, caplog):
    # stop_at_accuracy 0.5: seed 1 stops at round 2, the others run their 3 rounds
    stop = {"stop_at_accuracy": 0.5, "rounds": 3}
    finals = {0: (0.3, 0.45, 0.64), 1: (0.3, 0.51), 2: (0.3, 0.44, 0.52)}
    done = [write_run(tmp_path / f"s{seed}", seed=seed, accuracies=acc, settings=stop) for seed, acc in finals.items()]
    cut = with_status(write_run(tmp_path / "int", seed=3, accuracies=(0.13,), settings=stop), "interrupted", 1)
    (row,) = results_table([fedsim.load_run(p) for p in [*done, cut]])
    assert f"left out as unfinished, beside the runs that finished: {cut} (interrupted at round 1 of 3)" in (
        caplog.messages
    )
    assert row["runs"] == 3 and row["final_accuracy"] == pytest.approx((0.64 + 0.51 + 0.52) / 3)
    assert (row["reached"], row["rounds_to_target"]) == (3, pytest.approx((3 + 2 + 3) / 3))
    assert (row["rounds_min"], row["rounds"], row["unfinished"]) == (2, 3, None)
    assert "| 2–3 |" in str(results_table([fedsim.load_run(p) for p in done]))
    # only the interrupted run: its figures, marked as such
    (alone,) = results_table([fedsim.load_run(cut)])
    assert alone["final_accuracy"] == pytest.approx(0.13) and alone["unfinished"] == "interrupted at round 1 of 3"
    assert "| 1 (interrupted at round 1 of 3) |" in str(results_table([fedsim.load_run(cut)]))
    assert [h.run_dir for h in fedsim.load_runs(tmp_path / "int")] == [cut]


def test_results_table_adds_the_keys_that_tell_its_rows_apart(tmp_path):
    runs = []
    for rule in ("fedavg", "median"):
        for attack in ("none", "sign_flip"):
            for seed in (0, 1):
                accuracies = (0.2, 0.4 + 0.1 * seed + 0.05 * (rule == "median") - 0.2 * (attack != "none"))
                path = write_run(
                    tmp_path / f"{rule}-{attack}-{seed}",
                    seed=seed,
                    accuracies=accuracies,
                    settings={"aggregator": rule, "attack.type": attack, "attack.fraction": 0.2},
                )
                runs.append(fedsim.load_run(path))
    table = results_table(runs, keys="aggregator")  # a string is one key
    assert table.columns[:2] == ["aggregator", "attack.type"]
    cells = [(row["aggregator"], row["attack.type"], row["runs"]) for row in table]
    assert cells == [(r, a, 2) for r in ("fedavg", "median") for a in ("none", "sign_flip")]
    # fedavg under sign_flip: seeds 0 and 1 end at 0.2 and 0.3
    assert table[1]["final_accuracy"] == pytest.approx((0.2 + 0.3) / 2)
    assert "| fedavg | sign\\_flip | 2 | 25.0 ± 7.1 |" in str(table)


def test_results_table_refuses_what_it_cannot_table(tmp_path):
    run = fedsim.load_run(write_run(tmp_path / "run", accuracies=(0.5,)))
    with pytest.raises(FedsimError, match=r"^results_table: no runs given; pass History objects"):
        results_table([])
    with pytest.raises(
        FedsimError,
        match=r"^aggregatr: not a config key of run 'run' \(did you mean 'aggregator'\?\); its keys: .*data\.\*, ",
    ):
        results_table([run], keys="aggregatr")
    with pytest.raises(
        FedsimError, match=r"^data.alpah: .* \(did you mean 'data.alpha'\?\); its keys: data.alpha, data.augment, "
    ):
        results_table([run], keys=("data.alpah",))


def test_an_empty_accuracy_cannot_break_the_spread():
    assert all(math.isnan(v) for v in mean_and_sd([math.nan, 0.5]))  # statistics.stdev would raise


def test_to_pandas_gives_nan_for_a_feature_the_run_had_off():
    pandas = pytest.importorskip("pandas")
    rows = [{"round": r, "test_accuracy": 0.5, "epsilon": None} for r in (1, 2)]
    frame = History(rows).to_pandas()
    assert frame["epsilon"].dtype == "float64" and frame["epsilon"].isna().all()
    assert pandas.api.types.is_integer_dtype(frame["round"])


def test_the_package_lists_its_public_names():
    assert {"run", "resume", "load_model", "load_runs", "results_table", "plot_runs", "data"} <= set(dir(fedsim))
    importlib.import_module("fedsim.engine")  # a layer of the package, imported: still not a public name

    assert [name for name in dir(fedsim) if name.startswith("_")] == ["__version__"]
    assert not {"sys", "importlib", "annotations", "engine", "core"} & set(dir(fedsim))


@pytest.mark.slow
def test_load_model_gives_the_trained_module(tmp_path):
    import torch

    from fedsim.data import load_dataset

    history = fedsim.run(
        {
            "name": "m",
            "seed": 2,
            "device": "cpu",
            "rounds": 2,
            "workers": 0,
            "clients_per_round": 2,
            "data": {"dataset": "synthetic", "num_clients": 4},
        },
        out=tmp_path / "run",
        quiet=True,
    )
    model = fedsim.load_model(history.run_dir)
    assert isinstance(model, torch.nn.Module) and not model.training
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert torch.equal(weights, torch.load(history.run_dir / "checkpoint.pt", weights_only=True)["global"])
    test = load_dataset("synthetic", "unused")
    with torch.no_grad():
        accuracy = (model(test.test_x).argmax(1) == test.test_y).float().mean().item()
    assert accuracy == pytest.approx(history.final_accuracy, abs=1e-6)  # what the run measured


@pytest.mark.parametrize(
    "algorithm, said",
    [
        ("fedavg", None),
        ("ditto", "this is the global model; the clients of algorithm ditto use models of their own"),
        ("fedproto", "algorithm fedproto exchanges no weights, so its global model never trained"),
    ],
)
def test_load_model_says_whose_model_it_gives_for_a_run_of_personal_models(tmp_path, caplog, algorithm, said):
    cfg = {
        "rounds": 1,
        "workers": 0,
        "clients_per_round": 2,
        "model": "mnist_2nn",
        "algorithm": algorithm,
        "data": {"dataset": "synthetic", "num_clients": 2, "limit": 200},
    }
    history = fedsim.run(cfg, out=tmp_path / "run", quiet=True)
    caplog.clear()
    fedsim.load_model(history.run_dir)
    warnings = [r.message for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == (said is not None)
    assert said is None or (warnings[0].startswith(f"{history.run_dir}: {said}") and "checkpoint.pt" in warnings[0])


def test_results_table_gives_a_language_models_loss_and_perplexity_and_each_features_figure():
    import math

    def lm(name: str, seed: int, loss: float, personal: float | None = None) -> History:
        rows = [{"round": 1, "test_accuracy": 0.3, "test_loss": loss, "test_perplexity": math.exp(loss)}]
        rows[0]["client_accuracy_mean"] = personal
        summary = {"wall_seconds": 9.0, **({"client_eval_model": "personal"} if personal is not None else {})}
        return History(rows, {"name": name, "seed": seed, "lora": {"rank": 8}}, None, summary)

    table = results_table([lm("fedit", 0, 2.4), lm("fedit", 1, 2.2), lm("fedsa", 0, 2.5, personal=0.31)])
    assert table.columns == [
        "name", "runs", "final_test_loss", "final_test_perplexity", "final_accuracy", "best_accuracy",
        "final_client_accuracy", "best_client_accuracy", "rounds", "wall_seconds",
    ]  # fmt: skip
    fedit, fedsa = table
    assert fedit["final_test_loss"] == pytest.approx(2.3)
    assert fedit["final_test_perplexity"] == pytest.approx((math.exp(2.4) + math.exp(2.2)) / 2)
    assert fedit["final_client_accuracy"] is None and fedsa["final_client_accuracy"] == 0.31
    lines = table.markdown().splitlines()
    assert lines[0] == (
        "| name | runs | final test loss | final ppl | final tok. acc. (%) | best tok. acc. (%) "
        "| final personal acc. (%) | best personal acc. (%) | rounds | wall (s) |"
    )
    assert lines[2] == "| fedit | 2 | 2.3000 | 10.02 | 30.0 ± 0.0 | 30.0 | – | – | 1 | 9.0 |"
    assert lines[3] == "| fedsa | 1 | 2.5000 | 12.18 | 30.0 | 30.0 | 31.0 | 31.0 | 1 | 9.0 |"
    # privacy: the epsilon spent, where some run has a privacy section
    private = History(
        [{"round": 1, "test_accuracy": 0.9, "test_loss": 0.3, "epsilon": 1.5}],
        {"name": "dp", "privacy": {"noise_multiplier": 1.0}},
        None,
        {},
    )
    plain = History([{"round": 1, "test_accuracy": 0.95, "test_loss": 0.2}], {"name": "plain"}, None, {})
    table = results_table([private, plain])
    assert "epsilon" in table.columns and "final_test_loss" not in table.columns
    assert [row["epsilon"] for row in table] == [1.5, None]


def test_results_table_scores_fedavg_and_personal_models_on_the_clients_own_splits(tmp_path):
    """FedAvg's clients scored with the global model and Ditto's and FedProto's with their own
    share one column, read from metrics.csv's client_accuracy_mean; a global model that never
    trained (FedProto's) is marked."""

    def run(algorithm: str, seed: int, test: tuple, clients: tuple, model: str) -> History:
        rows = [
            {"round": r, "test_accuracy": t, "test_loss": 1.0, "client_accuracy_mean": c}
            for r, (t, c) in enumerate(zip(test, clients), start=1)
        ]
        summary = {"wall_seconds": 2.0, "client_eval_model": model}
        if algorithm == "fedproto":
            summary["global_model_trained"] = False
        return History(
            rows, {"name": "b", "algorithm": algorithm, "seed": seed}, tmp_path / f"{algorithm}{seed}", summary
        )

    fedavg = [run("fedavg", s, (0.12, 0.45), (0.11, 0.46 + s / 100), "global") for s in (0, 1)]
    ditto = run("ditto", 0, (0.12, 0.45), (0.28, 0.58), "personal")
    fedproto = run("fedproto", 0, (0.07, 0.07), (0.47, 0.54), "personal")
    table = results_table([*fedavg, ditto, fedproto], keys="algorithm")
    assert table.columns == [
        "algorithm", "runs", "final_accuracy", "best_accuracy", "final_client_accuracy", "best_client_accuracy",
        "clients_use", "rounds", "wall_seconds",
    ]  # fmt: skip
    first, second, third = table
    assert first["final_client_accuracy"] == pytest.approx((0.46 + 0.47) / 2)
    assert first["best_client_accuracy"] == pytest.approx((0.46 + 0.47) / 2)
    assert (first["clients_use"], second["clients_use"], third["clients_use"]) == ("global", "personal", "personal")
    lines = table.markdown().splitlines()
    assert lines[0] == (
        "| algorithm | runs | final global acc. (%) | best global acc. (%) | final client acc. (%) "
        "| best client acc. (%) | clients use | rounds | wall (s) |"
    )
    assert lines[2] == "| fedavg | 2 | 45.0 ± 0.0 | 45.0 | 46.5 | 46.5 | global | 2 | 2.0 |"
    assert lines[3] == "| ditto | 1 | 45.0 | 45.0 | 58.0 | 58.0 | personal | 2 | 2.0 |"
    assert lines[4] == "| fedproto | 1 | 7.0 (never trained) | 7.0 (never trained) | 54.0 | 54.0 | personal | 2 | 2.0 |"
    # a run of FedAvg alone with eval_per_client: still which model its clients used
    alone = results_table(fedavg[:1], keys="algorithm").markdown().splitlines()
    assert alone[2] == "| fedavg | 45.0 | 45.0 | 46.0 | 46.0 | global | 2 | 2.0 |"
