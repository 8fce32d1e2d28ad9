"""Language models for token-level tasks: int64 token ids [B, T] in, float logits [B, T, V] out,
trained with cross-entropy on the next token at every position (IGNORE_INDEX where none is
scored).

Two kinds: ``char_transformer``, a small decoder-only transformer registered beside the other
models, and ``hf:<hub name or folder>``, a causal language model of Hugging Face transformers
(Wolf et al. 2020, "Transformers: State-of-the-Art Natural Language Processing"), imported only
when such a model is built so that ``import fedsim`` stays fast without it.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.errors import ConfigError, cut, install
from ..data.hub import hub_unreachable
from .zoo import MODELS

HF_PREFIX = "hf:"
INSTALL = install("llm")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
WEIGHT_FILES = ("*.safetensors", "*.bin")
_HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")


# ----------------------------------------------------------------------------- char_transformer


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which a position sees itself and those before it."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.c_attn = nn.Linear(width, 3 * width)  # queries, keys and values in one product
        self.c_proj = nn.Linear(width, width)
        self.heads = heads
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, steps, width = x.shape
        q, k, v = (
            t.view(batch, steps, self.heads, width // self.heads).transpose(1, 2)
            for t in self.c_attn(x).split(width, dim=2)
        )
        attention_dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=attention_dropout, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, steps, width)
        return F.dropout(self.c_proj(y), self.dropout, self.training)


class MLP(nn.Module):
    """The feed-forward half of a block: 4x wider, GELU, back to the width."""

    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(width, 4 * width)
        self.c_proj = nn.Linear(4 * width, width)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.c_proj(F.gelu(self.c_fc(x))), self.dropout, self.training)


class Block(nn.Module):
    """A pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, dropout)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CharTransformer(nn.Module):
    """A small decoder-only transformer of the shape of GPT-2 (Radford et al. 2019, "Language
    Models are Unsupervised Multitask Learners") as Karpathy's nanoGPT builds it (karpathy/nanoGPT,
    model.py): learned token and position embeddings, pre-LayerNorm blocks of causal
    self-attention and a 4x GELU MLP, a final LayerNorm and an output head that shares the token
    embedding's weights. Initialized as nanoGPT does: normal weights of std 0.02, the residual
    projections (``c_proj``) 0.02 / sqrt(2 * layers), zero biases. Takes int64 token ids [B, T]
    with T at most ``sequence_length``; 842,496 parameters for 256 ids, T = 128 and the default
    sizes (4 layers, 4 heads, width 128)."""

    lora_targets = ("c_attn",)  # what LoRA adapts by default, as peft does for GPT-2

    def __init__(
        self,
        vocab_size: int,
        sequence_length: int,
        layers: int = 4,
        heads: int = 4,
        width: int = 128,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.sequence_length = sequence_length
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, width),
                wpe=nn.Embedding(sequence_length, width),
                drop=nn.Dropout(dropout),
                h=nn.ModuleList(Block(width, heads, dropout) for _ in range(layers)),
                ln_f=nn.LayerNorm(width),
            )
        )
        self.lm_head = nn.Linear(width, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying (Press & Wolf 2017)
        self.apply(self._init_weights)
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaling of what each residual branch adds
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        steps = ids.shape[1]
        if steps > self.sequence_length:
            raise ValueError(
                f"a sequence of {steps} tokens is longer than the {self.sequence_length} positions it was built for"
            )
        positions = torch.arange(steps, device=ids.device)
        x = self.transformer.drop(self.transformer.wte(ids) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


@MODELS.register(
    "char_transformer",
    "a small GPT-2-shaped transformer as nanoGPT builds it: 4 layers, 4 heads, width 128 (842,496 "
    "parameters for 256 ids and sequences of 128); int64 token ids, logits at every position",
)
def char_transformer(
    input_shape: tuple[int, ...],
    num_classes: int,
    *,
    layers: int = 4,
    heads: int = 4,
    width: int = 128,
    dropout: float = 0.0,
) -> CharTransformer:
    if len(input_shape) != 1:
        raise ValueError(f"it reads sequences of token ids, shape (steps,), not inputs of shape {tuple(input_shape)}")
    sequence_length = _positive("the sequence length", input_shape[0])
    for name, value in (("layers", layers), ("heads", heads), ("width", width)):
        _positive(name, value)
    if width % heads:
        raise ValueError(f"heads ({heads}) must divide width ({width}): each head takes an equal share")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"dropout must be a probability in [0, 1), got {dropout!r}")
    return CharTransformer(_positive("the vocabulary", num_classes), sequence_length, layers, heads, width, dropout)


# ----------------------------------------------------------------------------- hf: models


def is_hf_model(spec: object) -> bool:
    """Whether a ``model`` spec names a transformers model (``hf:<hub name or folder>``)."""
    return isinstance(spec, str) and spec.startswith(HF_PREFIX)


class CausalLM(nn.Module):
    """A transformers causal language model as fedsim calls a model: ids [B, T] -> logits
    [B, T, V], in the model's own dtype. No attention mask: padding only ever ends a sequence
    and its targets are not scored, so no scored position attends to it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


def hf_model(spec: str, input_shape: tuple[int, ...], num_classes: int, **options: Any) -> CausalLM:
    """The causal language model ``spec`` names: ``hf:<folder>`` with weights (``*.safetensors``,
    ``*.bin``) loads them, ``hf:<folder>`` with only a config.json is initialized at random from
    torch's seed, ``hf:<hub name>`` loads from the hub or its cache. ``options`` go to transformers
    (``dtype: bfloat16`` and the like as text). Under ``torch.device("meta")`` every kind is built
    from its config alone: there are no weights to read into it."""
    transformers = _import_transformers(spec)
    target = spec[len(HF_PREFIX) :]
    if len(input_shape) != 1:
        raise ConfigError(f"model: {spec} reads sequences of token ids, shape (steps,), not inputs of {input_shape}")
    kwargs = parse_options(spec, options)
    config, source, weighted, cached = _config(transformers, spec, target)
    if cached:
        kwargs["local_files_only"] = True
    vocabulary = getattr(config, "vocab_size", None)
    if isinstance(vocabulary, int) and vocabulary < num_classes:
        raise ConfigError(
            f"model: {spec} has a vocabulary of {vocabulary} tokens, fewer than the {num_classes} ids of "
            f"data.tokenizer; give the model's own tokenizer (data.tokenizer: {spec})"
        )
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and input_shape[0] > positions:
        raise ConfigError(
            f"model: {spec} reads at most {positions} positions; lower data.sequence_length ({input_shape[0]})"
        )
    if torch.empty(0).device.type == "meta":
        weighted = False  # from_pretrained refuses the meta device, and there is nothing to read into it
    with _quiet(transformers):
        try:
            if weighted:
                model = transformers.AutoModelForCausalLM.from_pretrained(source, config=config, **kwargs)
            else:
                model = transformers.AutoModelForCausalLM.from_config(config, **kwargs)
        except (OSError, ValueError, TypeError, KeyError, RuntimeError) as e:
            raise ConfigError(f"model: {spec}: cannot build it ({failure_reason(e)})") from None
    return CausalLM(model)


def _import_transformers(spec: str) -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"model: {spec} needs transformers: {INSTALL}") from None
    return transformers


def parse_options(spec: str, options: dict) -> dict:
    """``options`` for transformers, a dtype given as text made a torch dtype (``torch_dtype``,
    the older name, given as ``dtype``, the name transformers 5 wants)."""
    kwargs = dict(options)
    if "dtype" in kwargs and "torch_dtype" in kwargs:
        raise ConfigError("model_options: give dtype or torch_dtype, not both")
    if "torch_dtype" in kwargs:
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    dtype = kwargs.get("dtype")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"model_options: dtype {dtype!r} of {spec} is not one of {', '.join(DTYPES)}")
        kwargs["dtype"] = DTYPES[dtype]
    elif dtype is not None and not isinstance(dtype, torch.dtype):
        raise ConfigError(f"model_options: dtype of {spec} must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return kwargs


def _config(transformers: Any, spec: str, target: str) -> tuple[Any, str, bool, bool]:
    """The model's configuration, what transformers loads it from (a folder's path or a hub
    name), whether weights lie beside it, and whether they must come from the cache alone."""
    if not target:
        raise ConfigError(f"model: {HF_PREFIX} needs a hub name or a local folder after it (hf:gpt2)")
    path = Path(target).expanduser()
    if path.is_file():
        raise ConfigError(f"model: {spec}: is a file; give the folder that holds config.json and the weights")
    if path.exists():
        if not (path / "config.json").is_file():
            raise ConfigError(
                f"model: {spec}: the folder {path} holds no config.json (save a model with save_pretrained)"
            )
        weighted = any(next(path.glob(pattern), None) for pattern in WEIGHT_FILES)
        return _read_config(transformers, spec, str(path), f"the folder {path}"), str(path), weighted, False
    if target.startswith(("/", ".", "~")) or not _HUB_NAME.fullmatch(target):
        raise ConfigError(f"model: {spec}: no such folder, and not a hub name (owner/name)")
    import huggingface_hub.constants as hub

    offline = bool(hub.HF_HUB_OFFLINE)
    unreachable = None if offline else hub_unreachable(hub.ENDPOINT)
    if not (offline or unreachable):
        return _read_config(transformers, spec, target, "the hub"), target, True, False
    try:
        config = transformers.AutoConfig.from_pretrained(target, local_files_only=True)
    except (OSError, ValueError) as e:
        # without network, one line at once rather than after the library's retries
        why = "HF_HUB_OFFLINE is set" if offline else f"the hub is out of reach ({unreachable})"
        raise ConfigError(
            f"model: {spec}: not in the Hugging Face cache ({hub.HF_HUB_CACHE}) and {why}; download it "
            f"first (AutoModelForCausalLM.from_pretrained({target!r}) with network) or give a local folder "
            f"(hf:/path/to/model) ({failure_reason(e)})"
        ) from None
    return config, target, True, True


def _read_config(transformers: Any, spec: str, source: str, where: str) -> Any:
    try:
        return transformers.AutoConfig.from_pretrained(source)
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"model: {spec}: cannot read its config from {where} ({failure_reason(e)})") from None


@contextlib.contextmanager
def _quiet(transformers: Any) -> Iterator[None]:
    """No progress bar for the weights' loading: it would break the run's lines."""
    logging = transformers.utils.logging
    shown = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            logging.enable_progress_bar()


def failure_reason(e: Exception) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {cut(lines[0], 200)}" if lines else type(e).__name__
