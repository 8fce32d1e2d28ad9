from pathlib import Path

import pytest

from fedsim.core.errors import ConfigError
from fedsim.experiment.config import Config
from fedsim.experiment.validation import load_config


def write(tmp_path, text):
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    return path


def test_defaults_and_required_keys_exist():
    cfg = Config()
    for key in (
        "name",
        "seed",
        "device",
        "rounds",
        "workers",
        "clients_per_round",
        "eval_every",
        "model",
        "aggregator",
    ):
        assert hasattr(cfg, key)
    for key in ("dataset", "root", "partition", "num_clients", "limit"):
        assert hasattr(cfg.data, key)
    for key in ("epochs", "batch_size", "lr", "momentum", "weight_decay"):
        assert hasattr(cfg.local, key)
    assert cfg.device == "auto" and cfg.workers is None


def test_data_root_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("FEDSIM_DATA", "/some/where")
    assert Config().data.root == "/some/where"
    monkeypatch.delenv("FEDSIM_DATA")
    monkeypatch.setenv("XDG_CACHE_HOME", "/the/cache")
    assert Config().data.root == "/the/cache/fedsim/datasets"  # one folder, whatever the directory
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", "/home/someone")
    assert Config().data.root == "/home/someone/.cache/fedsim/datasets"


def test_yaml_and_overrides(tmp_path):
    path = write(tmp_path, "name: x\nrounds: 4\nlocal:\n  lr: 0.1\ndata:\n  num_clients: 20\n")
    cfg = load_config(path, ["local.lr=0.05", "rounds=7", "data.limit=1000", "local.weight_decay=1e-4", "workers=null"])
    assert cfg.name == "x" and cfg.rounds == 7 and cfg.local.lr == 0.05
    assert cfg.data.limit == 1000 and cfg.data.num_clients == 20
    assert cfg.local.weight_decay == 1e-4  # YAML reads 1e-4 as text; a float key takes it as a number
    assert cfg.workers is None


def test_dict_overrides_with_dots_and_sections():
    cfg = load_config({"rounds": 2}, {"local.lr": 0.2, "data": {"num_clients": 30}})
    assert cfg.local.lr == 0.2 and cfg.data.num_clients == 30 and cfg.rounds == 2


def test_unknown_key_is_named_with_a_suggestion(tmp_path):
    path = write(tmp_path, "rounds: 3\nlocal:\n  lr: 0.1\n  epoch: 2\n")
    with pytest.raises(ConfigError, match=r"exp.yaml: local.epoch: unknown key; did you mean 'local.epochs'"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"--set roundz: unknown key; did you mean 'rounds'"):
        load_config({}, ["roundz=3"])
    # a section's key given on its own is that key, not a top-level one spelled alike (lr is not lora)
    with pytest.raises(ConfigError, match=r"^keyword lr: unknown key; did you mean 'local.lr'\?$"):
        load_config({}, {"lr": 0.05})
    with pytest.raises(ConfigError, match=r"^keyword alpha: unknown key; did you mean 'data.alpha' or 'lora.alpha'\?$"):
        load_config({}, {"alpha": 0.1})
    # from Python, the keyword the user passed
    with pytest.raises(ConfigError, match=r"^keyword roundz: unknown key; did you mean 'rounds'"):
        load_config({}, {"roundz": 3})
    with pytest.raises(ConfigError, match=r"^keyword data.alpha: must be > 0, got 0.0"):
        load_config({}, {"data": {"alpha": 0}})


@pytest.mark.parametrize(
    "text, message",
    [
        ("rounds: three\n", "rounds: expected an integer, got str 'three'"),
        ("rounds: 0\n", "rounds: must be >= 1"),
        ("local:\n  lr: -0.1\n", "local.lr: must be > 0"),
        ("clients_per_round: 50\n", "clients_per_round: must be <= data.num_clients"),
        ("model: resnet180\n", "model: unknown model 'resnet180' (did you mean 'resnet18'?); choose one of:"),
        ("device: tpu\n", "device: must be auto, cpu, cuda or cuda:N"),
    ],
)
def test_bad_values_are_rejected_in_one_line(tmp_path, text, message):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_numbers_in_exponent_form_are_numbers_everywhere():
    # YAML 1.1 reads 1e-3 as text; in a file, in --set and inside option mappings it is a number
    cfg = load_config({}, ["local.lr=1e-3", "aggregator=norm_clip", "aggregator_options.max_norm=2E1"])
    assert cfg.local.lr == 0.001 and cfg.aggregator_options == {"max_norm": 20.0}


def test_one_override_may_be_given_as_a_string():
    assert load_config({}, "rounds=4").rounds == 4


def test_an_empty_section_is_no_keys(tmp_path):
    cfg = load_config(write(tmp_path, "rounds: 2\nlocal:\n  # lr: 0.1\n"), ["local.epochs=3"])
    assert cfg.local.epochs == 3 and cfg.local.lr == 0.01


# ----------------------------------------------------------------------------- one declaration per section


def test_every_key_is_declared_once_with_its_meaning_and_the_docs_table_is_made_from_them():
    import dataclasses
    from pathlib import Path

    from fedsim.core.sections import key_rows, sections
    from fedsim.experiment.config import key_table

    rows = list(key_rows(Config))
    keys = [key for key, _, _ in rows]
    assert len(keys) == len(set(keys)) and all(doc for _, _, doc in rows)
    # every field of every section is a row, and nothing else is
    declared = {
        f"{name}.{f.name}" if name else f.name
        for name, section in sections(Config(privacy=None))
        for f in dataclasses.fields(section)
        if not dataclasses.is_dataclass(getattr(section, f.name))
    }
    assert declared - {"privacy"} <= set(keys) and {"privacy.clip", "lora.rank", "data.beta"} <= set(keys)
    docs = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
    assert key_table() in docs.read_text(), "docs/configuration.md's key table is not experiment.config.key_table()"


def test_fedsim_list_keys_prints_every_key_with_its_default(capsys):
    from fedsim.cli import main
    from fedsim.core.sections import key_rows

    with pytest.raises(SystemExit) as end:
        main(["list", "keys"])
    assert end.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [key for key, _, _ in key_rows(Config)]
    assert any(line.split()[:2] == ["lora.method", "[fedit]"] for line in lines)
    from fedsim.algorithms import ALGORITHMS

    algorithm = next(line for line in lines if line.split()[0] == "algorithm")
    assert all(f" {name}," in algorithm for name in ALGORITHMS.names())  # every registered one, by the registry
    table = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    assert all(f"`{name}`" in table.split("| `algorithm` |")[1].split("\n")[0] for name in ALGORITHMS.names())


@pytest.mark.parametrize(
    ("changes", "warning"),
    [
        ({"data": {"beta": 3}}, "data.beta is 3.0 but data.partition iid does not use it"),
        (
            {"data": {"partition": "dirichlet", "sigma": 2}},
            "data.sigma is 2.0 but data.partition dirichlet does not use it",
        ),
        ({"lora": {"method": "ffa"}}, "lora.method is 'ffa' but lora.rank is 0: no adapters"),
        ({"local": {"beta2": 0.99}}, "local.beta2 is 0.99 but local.optimizer is sgd: it is adamw's"),
        ({"server_momentum": 0.5}, "server_momentum is 0.5 but server_optimizer is none"),
        ({"vmap_group_size": 2}, "vmap_group_size is 2 but backend is process: it is vmap's"),
        ({"attack": {"scale": 3}}, "attack.scale is 3.0 but attack.type none does not use it"),
    ],
)
def test_a_key_set_but_not_read_is_warned_about_in_one_wording(changes, warning):
    from fedsim.experiment.validation import unused_settings

    assert unused_settings(load_config(changes)) == [warning]
    assert unused_settings(load_config({})) == []


def test_a_partition_option_it_does_not_take_is_refused_by_the_one_helper():
    from fedsim.data import partition

    with pytest.raises(ConfigError, match=r"^data.partition: iid takes no option 'alpha'; it takes no options$"):
        partition([0, 1, 2, 3], "iid", 2, seed=0, alpha=0.5)


def test_fedsim_models_is_a_package_and_the_short_names_stay():
    import importlib

    import fedsim

    models = importlib.import_module("fedsim.models")
    assert models.__file__.endswith("models/__init__.py") and "char_transformer" in models.MODELS
    assert fedsim.models is models and callable(fedsim.aggregation.get) and fedsim.callbacks.TensorBoard
    from fedsim import aggregation, attacks

    assert aggregation.__name__ == "fedsim.fl.aggregation" and attacks.__name__ == "fedsim.fl.attacks"
    # and importable under those names, as the same modules
    import fedsim.attacks
    from fedsim.aggregation import get
    from fedsim.callbacks import TensorBoard

    assert get is aggregation.get and fedsim.attacks is attacks and TensorBoard is fedsim.runs.callbacks.TensorBoard


def test_the_keys_grouped_by_what_they_mean_for_a_run_are_declared_keys():
    from fedsim.experiment.config import KEYS
    from fedsim.results.keys import PLACEMENT_KEYS, RESUMABLE_KEYS, RUN_SPECIFIC_KEYS

    assert PLACEMENT_KEYS | RESUMABLE_KEYS | RUN_SPECIFIC_KEYS <= KEYS


def test_a_section_set_as_a_mapping_keeps_its_other_keys():
    raw = {"local": {"lr": 0.1, "momentum": 0.9}}
    for overrides in (["local={lr: 0.5}"], {"local": {"lr": 0.5}}):
        cfg = load_config(raw, overrides)
        assert (cfg.local.lr, cfg.local.momentum) == (0.5, 0.9)
    # an option mapping is one key, set whole
    rule = {"aggregator": "multi_krum", "aggregator_options": {"f": 1, "m": 2}}
    assert load_config(rule, ["aggregator_options={f: 2}"]).aggregator_options == {"f": 2}


def test_a_wrapped_rule_is_named_by_the_module_attribute_that_holds_it(tmp_path, monkeypatch):
    """remembering (as functools.wraps) gives its wrapper the function's name, under which the
    module holds the unwrapped function: config.yaml must name what imports the rule again."""
    import importlib

    from fedsim.experiment.config import describe

    (tmp_path / "my_rules_for_naming.py").write_text(
        "import torch\n"
        "import fedsim.aggregation\n\n\n"
        "def _momentum(updates, weights, beta=0.5, memory=None):\n"
        "    memory.new['m'] = beta * memory.kept['m'] + (1 - beta) * updates.mean(dim=0)\n"
        "    return memory.new['m'].clone()\n\n\n"
        "momentum = fedsim.aggregation.remembering(_momentum, lambda w: {'m': torch.zeros_like(w)})\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("my_rules_for_naming")
    assert describe(module.momentum) == "my_rules_for_naming:momentum"
    assert describe(module._momentum) == "my_rules_for_naming:_momentum"
    config = load_config({"aggregator": module.momentum, "aggregator_options": {"beta": 0.9}})  # probed: no memory
    assert describe(config.aggregator) == "my_rules_for_naming:momentum"
    assert load_config({"aggregator": "my_rules_for_naming:momentum"}).aggregator == "my_rules_for_naming:momentum"
