"""Language models: char_transformer (nanoGPT's shape) and hf: causal language models, built from
tiny configurations saved in tmp_path (no network, no downloaded weights)."""

import math
import sys
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from support import Later, installed

from fedsim.core.errors import ConfigError
from fedsim.experiment.components import build_model
from fedsim.models import language as language_models
from fedsim.models.language import CausalLM, CharTransformer, char_transformer, hf_model, is_hf_model
from fedsim.models.zoo import MODELS

pytestmark = pytest.mark.skipif(not installed("transformers", "peft"), reason="needs transformers and peft")
transformers, peft = Later("transformers"), Later("peft")


def count(model):
    return sum(p.numel() for p in model.parameters())


def nanogpt_parameters(vocab, steps, layers, width):
    """Counted by hand: token and position tables (the head shares the token table), and per
    block two LayerNorms (2 * 2C), c_attn (C x 3C + 3C), attn.c_proj (C x C + C), c_fc
    (C x 4C + 4C), mlp.c_proj (4C x C + C); then the final LayerNorm."""
    block = 2 * 2 * width + (3 * width * width + 3 * width) + (width * width + width)
    block += (4 * width * width + 4 * width) + (4 * width * width + width)
    return vocab * width + steps * width + layers * block + 2 * width


def byte_windows(text: bytes, steps: int, stride: int):
    ids = torch.tensor(list(text))
    starts = range(0, len(ids) - steps - 1, stride)
    return torch.stack([ids[s : s + steps] for s in starts]), torch.stack([ids[s + 1 : s + steps + 1] for s in starts])


# ----------------------------------------------------------------------------- char_transformer


def test_char_transformer_has_nanogpts_parameter_count():
    assert count(char_transformer((128,), 256)) == nanogpt_parameters(256, 128, 4, 128) == 842_496
    model = char_transformer((64,), 80, layers=2, heads=2, width=32)
    assert count(model) == nanogpt_parameters(80, 64, 2, 32)
    assert "842,496" in dict(MODELS.describe())["char_transformer"]


def test_the_output_head_is_the_token_embedding():
    model = char_transformer((16,), 256, layers=1, heads=2, width=32)
    assert model.lm_head.weight is model.transformer.wte.weight
    ids = torch.randint(0, 256, (2, 16))
    F.cross_entropy(model(ids).flatten(0, -2), ids.flatten()).backward()
    # one tensor, one gradient: the embedding's lookups and the head's products both land in it
    assert model.transformer.wte.weight.grad is model.lm_head.weight.grad


def test_nanogpts_initialization():
    torch.manual_seed(0)
    layers = 4
    model = char_transformer((128,), 256, layers=layers)
    weights = dict(model.named_parameters())
    projections = torch.cat([w.flatten() for n, w in weights.items() if n.endswith("c_proj.weight")])
    others = torch.cat([model.transformer.h[0].attn.c_attn.weight.flatten(), model.transformer.wte.weight.flatten()])
    # the std of 100k+ normal draws is within 2 % of the true one (its relative error ~ 1/sqrt(2n))
    assert projections.std().item() == pytest.approx(0.02 / math.sqrt(2 * layers), rel=0.02)
    assert others.std().item() == pytest.approx(0.02, rel=0.02)
    biases = [w for n, w in weights.items() if n.endswith(".bias") and ".ln_" not in n]
    assert biases and all(torch.count_nonzero(b) == 0 for b in biases)


def test_a_token_changes_no_logit_before_it():
    torch.manual_seed(0)
    model = char_transformer((16,), 256, layers=2, heads=4, width=32).eval()
    ids = torch.randint(0, 256, (3, 16))
    changed = ids.clone()
    changed[:, 9] = (ids[:, 9] + 1) % 256
    before, after = model(ids), model(changed)
    torch.testing.assert_close(after[:, :9], before[:, :9], rtol=1e-5, atol=1e-5)
    assert (after[:, 9:] - before[:, 9:]).abs().amax() > 1e-3  # from t on it sees the change


def test_a_few_dozen_sgd_steps_learn_a_repeated_text():
    x, y = byte_windows(b"to be, or not to be, that is the question. " * 6, steps=32, stride=6)
    frequencies = torch.bincount(y.flatten(), minlength=256).double()
    frequencies = frequencies[frequencies > 0] / frequencies.sum()
    unigram = -(frequencies * frequencies.log()).sum().item()  # the best loss without context: 2.40
    torch.manual_seed(0)
    model = char_transformer((32,), 256, layers=2, heads=2, width=64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first = None
    for _ in range(40):
        loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    assert first == pytest.approx(math.log(256), abs=0.05)  # small initial logits: about uniform
    assert loss.item() < unigram - 0.3  # it reads the characters before each one (1.73 measured)


def test_dropout_follows_the_callers_seed():
    model = char_transformer((16,), 256, layers=1, heads=2, width=32, dropout=0.5).train()
    ids = torch.randint(0, 256, (2, 16))
    torch.manual_seed(5)
    first = model(ids)
    torch.manual_seed(5)
    assert torch.equal(model(ids), first)
    assert not torch.equal(model(ids), first)
    model.eval()
    assert torch.equal(model(ids), model(ids))


@pytest.mark.parametrize(
    "shape, options, words",
    [
        ((16,), {"heads": 3}, "heads (3) must divide width (128)"),
        ((16,), {"layers": 0}, "layers must be at least 1"),
        ((16,), {"width": 64.0}, "width must be a whole number"),
        ((16,), {"dropout": 1.0}, "dropout must be a probability in [0, 1)"),
        ((1, 28, 28), {}, "not inputs of shape (1, 28, 28)"),
    ],
)
def test_bad_sizes_are_refused_in_plain_words(shape, options, words):
    with pytest.raises((ValueError, TypeError)) as error:
        char_transformer(shape, 256, **options)
    assert words in str(error.value) and "\n" not in str(error.value)


def test_an_unknown_option_and_a_bad_shape_reach_the_user_as_one_config_line():
    with pytest.raises(TypeError, match="unexpected keyword argument 'depth'"):
        char_transformer((16,), 256, depth=2)
    with pytest.raises(ConfigError) as error:
        build_model("char_transformer", (1, 28, 28), 10)
    assert str(error.value).startswith("model: char_transformer failed when it was built (ValueError: it reads")


def test_a_longer_sequence_than_the_position_table_is_refused():
    model = char_transformer((8,), 256, layers=1, heads=1, width=8)
    with pytest.raises(ValueError, match="a sequence of 9 tokens is longer than the 8 positions"):
        model(torch.zeros(1, 9, dtype=torch.long))
    assert model(torch.zeros(1, 5, dtype=torch.long)).shape == (1, 5, 256)


def test_peft_adapts_char_transformers_attention():
    torch.manual_seed(0)
    model = char_transformer((16,), 256, layers=2, heads=2, width=32).eval()
    ids = torch.randint(0, 256, (2, 16))
    before = model(ids)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(model.lora_targets)))
    trainable = {n: p.numel() for n, p in adapted.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * 2 and all(".attn.c_attn.lora_" in n for n in trainable)
    assert sum(trainable.values()) == 2 * (32 * 4 + 4 * 96)  # per layer A: r x C, B: 3C x r
    torch.testing.assert_close(adapted(ids), before)  # B starts at zero: the adapters add nothing yet


# ----------------------------------------------------------------------------- hf: models


def llama_config(**changes):
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return transformers.LlamaConfig(**{"vocab_size": 256, "num_key_value_heads": 4, **sizes, **changes})


def gpt2_config():
    return transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64)


@pytest.fixture
def llama_folder(tmp_path):
    folder = tmp_path / "llama-config"
    llama_config().save_pretrained(folder)
    return folder


def weights(module):
    return {name: tensor.clone() for name, tensor in module.state_dict().items()}


def test_is_hf_model():
    assert is_hf_model("hf:gpt2") and is_hf_model("hf:/models/tiny")
    assert not is_hf_model("char_transformer") and not is_hf_model(CharTransformer) and not is_hf_model(None)


@pytest.mark.parametrize("config", [llama_config, gpt2_config])
def test_a_folder_with_a_config_only_gives_a_random_model_from_torchs_seed(tmp_path, config):
    config().save_pretrained(tmp_path)
    spec = f"hf:{tmp_path}"
    torch.manual_seed(3)
    first = hf_model(spec, (16,), 256)
    torch.manual_seed(3)
    again = hf_model(spec, (16,), 256)
    torch.manual_seed(4)
    other = hf_model(spec, (16,), 256)
    assert isinstance(first, CausalLM) and isinstance(first.model, transformers.PreTrainedModel)
    for name, tensor in weights(first).items():
        assert torch.equal(tensor, weights(again)[name]), name
    assert any(not torch.equal(t, weights(other)[n]) for n, t in weights(first).items())
    logits = first(torch.randint(0, 256, (3, 16)))
    assert logits.shape == (3, 16, 256) and logits.dtype == torch.float32


def test_a_folder_with_weights_gives_those_weights_exactly(tmp_path):
    torch.manual_seed(0)
    saved = transformers.AutoModelForCausalLM.from_config(llama_config())
    saved.save_pretrained(tmp_path)
    torch.manual_seed(1)  # no draw may reach the loaded weights
    loaded = hf_model(f"hf:{tmp_path}", (16,), 200)
    expected = weights(saved)
    assert weights(loaded.model).keys() == expected.keys()
    for name, tensor in weights(loaded.model).items():
        assert torch.equal(tensor, expected[name]), name
    ids = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(loaded(ids), saved(input_ids=ids, use_cache=False).logits, rtol=0, atol=0)


def test_a_dtype_given_as_text(llama_folder):
    model = hf_model(f"hf:{llama_folder}", (8,), 256, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert hf_model(f"hf:{llama_folder}", (8,), 256, torch_dtype="float16").model.dtype == torch.float16
    assert model(torch.zeros(1, 8, dtype=torch.long)).dtype == torch.bfloat16  # the caller upcasts for its loss
    with pytest.raises(ConfigError, match="model_options: dtype 'half' of hf:.* is not one of bfloat16, float16"):
        hf_model(f"hf:{llama_folder}", (8,), 256, dtype="half")


def test_other_options_reach_transformers(llama_folder):
    model = hf_model(f"hf:{llama_folder}", (8,), 256, attn_implementation="eager")
    assert model.model.config._attn_implementation == "eager"


def test_a_vocabulary_smaller_than_the_tokenizers_is_one_line(llama_folder):
    with pytest.raises(ConfigError) as error:
        hf_model(f"hf:{llama_folder}", (8,), 50_257)
    assert str(error.value) == (
        f"model: hf:{llama_folder} has a vocabulary of 256 tokens, fewer than the 50257 ids of "
        f"data.tokenizer; give the model's own tokenizer (data.tokenizer: hf:{llama_folder})"
    )


def test_a_sequence_longer_than_the_models_positions_is_one_line(tmp_path):
    gpt2_config().save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=r"reads at most 64 positions; lower data.sequence_length \(65\)"):
        hf_model(f"hf:{tmp_path}", (65,), 256)


def test_missing_folders_and_files_are_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no such folder, and not a hub name"):
        hf_model(f"hf:{tmp_path / 'absent'}", (8,), 256)
    with pytest.raises(ConfigError, match="holds no config.json"):
        hf_model(f"hf:{tmp_path}", (8,), 256)
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="is a file; give the folder that holds config.json"):
        hf_model(f"hf:{tmp_path / 'model.safetensors'}", (8,), 256)
    with pytest.raises(ConfigError, match="needs a hub name or a local folder after it"):
        hf_model("hf:", (8,), 256)
    with pytest.raises(ConfigError, match=r"shape \(steps,\), not inputs of \(1, 28, 28\)"):
        hf_model(f"hf:{tmp_path}", (1, 28, 28), 256)


@pytest.fixture
def hub_out_of_reach(monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(hub, "ENDPOINT", "http://127.0.0.1:1")  # nothing listens: refused at once
    for proxy in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(proxy, raising=False)


def test_a_hub_name_out_of_reach_and_not_cached_is_one_line_at_once(hub_out_of_reach):
    started = time.monotonic()
    with pytest.raises(ConfigError) as error:
        hf_model("hf:fedsim-tests/no-such-model", (8,), 256)
    assert time.monotonic() - started < 5  # not the library's retries
    message = str(error.value)
    assert message.startswith("model: hf:fedsim-tests/no-such-model: not in the Hugging Face cache (")
    assert "the hub is out of reach (127.0.0.1: Connection refused)" in message and "\n" not in message


def test_a_hub_name_offline_is_one_line(monkeypatch):
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConfigError, match="not in the Hugging Face cache .* and HF_HUB_OFFLINE is set"):
        hf_model("hf:fedsim-tests/no-such-model", (8,), 256)


def test_without_transformers_one_line_names_the_extra(llama_folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(ConfigError) as error:
        hf_model(f"hf:{llama_folder}", (8,), 256)
    assert str(error.value) == f'model: hf:{llama_folder} needs transformers: pip install "fedsim-sync[llm]"'


def test_peft_adapts_an_hf_model(llama_folder):
    torch.manual_seed(0)
    model = hf_model(f"hf:{llama_folder}", (8,), 256)
    ids = torch.randint(0, 256, (2, 8))
    before = model(ids)
    model.model = peft.get_peft_model(model.model, peft.LoraConfig(r=4, lora_alpha=8))  # peft's Llama default
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert sum(trainable.values()) == 2 * 2 * (32 * 4 + 4 * 32)  # q_proj and v_proj of 2 layers, A and B
    torch.testing.assert_close(model(ids), before)


# ----------------------------------------------------------------------------- the meta device


def test_models_build_on_the_meta_device(tmp_path, llama_folder):
    transformers.AutoModelForCausalLM.from_config(gpt2_config()).save_pretrained(tmp_path / "weights")
    with torch.device("meta"):
        small = char_transformer((128,), 256)
        random = hf_model(f"hf:{llama_folder}", (16,), 256)
        trained = hf_model(f"hf:{tmp_path / 'weights'}", (16,), 256)  # from_pretrained refuses meta: shapes only
    for model in (small, random, trained):
        assert {p.device.type for p in model.parameters()} == {"meta"}
    assert small.lm_head.weight is small.transformer.wte.weight
    assert count(small) == 842_496 and count(trained.model) == count(transformers.GPT2LMHeadModel(gpt2_config()))
    adapted = peft.get_peft_model(small, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"]))
    assert {p.device.type for p in adapted.parameters()} == {"meta"}


def test_the_models_module_does_not_import_the_language_models():
    import ast
    from pathlib import Path

    source = Path(language_models.__file__).with_name("zoo.py").read_text()
    imported = {getattr(node, "module", None) for node in ast.walk(ast.parse(source))}
    assert "language" not in imported and "char_transformer" in MODELS


@pytest.mark.slow
def test_a_warning_of_transformers_or_peft_shows_once_not_once_per_process(tmp_path, capfd):
    """A GPT-2 with LoRA makes transformers say its config's token ids are out of the vocabulary
    and peft that Conv1D is transposed: the server says each once, the workers, which build the
    same model, nothing."""
    from test_text_data import play_root, play_run

    import fedsim

    root, _ = play_root(tmp_path)
    transformers.GPT2Config(vocab_size=256, n_embd=32, n_layer=1, n_head=2, n_positions=64).save_pretrained(
        tmp_path / "gpt2"
    )
    cfg = play_run(root, {"sequence_length": 8}, workers=2, model=f"hf:{tmp_path / 'gpt2'}", lora={"rank": 2})
    with warnings.catch_warnings():
        warnings.simplefilter("always")  # the server's as a user's process shows them, once each
        fedsim.run(cfg, out=tmp_path / "run", quiet=True)
    err = capfd.readouterr().err
    assert err.count("bos_token_id must be") <= 1 and err.count("fan_in_fan_out is set to False") <= 1, err
