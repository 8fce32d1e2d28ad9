"""A model whose state lives in flat tensors.

Trainable parameters (and, in a model without frozen parameters, floating-point buffers such
as batch-norm statistics) become views into ``flat``, and their gradients views into ``grad``.
Loading the global weights, storing a client's weights and taking an SGD step are then a
handful of whole-tensor operations, whatever the number of layers.

A model with frozen parameters (LoRA adapters on a pretrained base) keeps only its trainable
parameters in ``flat``: its frozen parameters and its buffers, which no client changes, are the
``base``, one flat tensor per dtype. The server builds the base once; a worker given it places
its model's frozen tensors there as views, so that every process uses one copy (shared memory on
a CPU, CUDA IPC on a GPU) and only the small trainable vector travels, is aggregated and is
checkpointed.
"""

from __future__ import annotations

import hashlib

import torch
import torch.nn as nn

from .errors import FedsimError


def check_same_base(checkpoint: dict, built: str | None, source: object, base_source: str) -> None:
    """Refuse to go on from a ``checkpoint`` (read from ``source``) that trained on another frozen base
    than the one built now (``built``: its ``FlatModel.base_digest``, taken before any round merges
    into it), which ``base_source`` gave. A checkpoint of an earlier version holds no fingerprint."""
    started_on = checkpoint.get("base_digest")
    if started_on is not None and started_on != built:
        raise FedsimError(
            f"{source}: the run trained on another frozen base than {base_source} gives now; "
            f"give it the base the run started from"
        )


def _frozen(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the frozen parameters and then the buffers, each tensor once, in module order."""
    params = [(name, p) for name, p in module.named_parameters() if not p.requires_grad]
    return params + list(module.named_buffers())


def _aliases(module: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """For each parameter or buffer (by id), every (owning module, attribute) that holds it: a
    tied weight has several."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for attribute, tensor in table.items():
                if tensor is not None:
                    holders.setdefault(id(tensor), []).append((owner, attribute))
    return holders


def _install(holders: list[tuple[nn.Module, str]], tensor: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    """``tensor`` in place of a parameter or buffer, at each of its holders; works on a model
    built on the meta device, whose tensors cannot be given new data."""
    owner, attribute = holders[0]
    value = nn.Parameter(tensor, requires_grad=requires_grad) if attribute in owner._parameters else tensor
    for owner, attribute in holders:
        table = owner._parameters if attribute in owner._parameters else owner._buffers
        table[attribute] = value
    return value


def flat_layout(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The named tensors a FlatModel's ``flat`` holds for ``module``, in its order: the trainable
    parameters, then, in a model without frozen parameters, the floating-point buffers (a frozen
    model's are in the base)."""
    params = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    if len(params) < len(list(module.parameters())):
        return params
    return params + [(name, b) for name, b in module.named_buffers() if b.is_floating_point()]


def flat_size(module: nn.Module) -> int:
    """The length of a FlatModel's ``flat`` for ``module``."""
    return sum(t.numel() for _, t in flat_layout(module))


def base_bytes(base: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in base.values())


class FlatModel:
    def __init__(
        self,
        module: nn.Module,
        device: torch.device | str,
        flat: torch.Tensor | None = None,
        base: dict[str, torch.Tensor] | None = None,
    ):
        """``flat``: a tensor to hold the state in, as it is (the module's own values are dropped);
        Hogwild's workers pass the shared global weights, so that every step lands there.
        ``base``: the frozen tensors as the server laid them out (a worker's model, which may be
        built on the meta device, takes views of them); None: the module's own become the base."""
        holders = _aliases(module)
        frozen = _frozen(module) if any(not p.requires_grad for p in module.parameters()) else []
        self.base = self._place_base(frozen, holders, torch.device(device), base) if frozen else {}
        params = [p for p in module.parameters() if p.requires_grad]
        if module_is_meta := any(p.is_meta for p in params):  # a worker's: its values come from the server
            params = [_install(holders[id(p)], torch.zeros(p.shape, device=device), True) for p in params]
        self.module = module if module_is_meta else module.to(device)
        buffers = [] if frozen else [b for b in module.buffers() if b.is_floating_point()]
        self.num_params = sum(p.numel() for p in params)  # flat[:num_params] are trainable
        if flat is None:
            flat = torch.cat([t.detach().reshape(-1) for t in params + buffers])
        elif flat.numel() != sum(t.numel() for t in params + buffers):
            raise ValueError(f"a flat state of {flat.numel()} values cannot hold this model's state")
        self.flat = flat
        self.grad = torch.zeros(self.num_params, device=self.flat.device)
        offset = 0
        for t in params + buffers:
            n = t.numel()
            t.data = self.flat[offset : offset + n].view_as(t)
            if offset < self.num_params:
                t.grad = self.grad[offset : offset + n].view_as(t)
            offset += n

    def base_digest(self) -> str | None:
        """A fingerprint of the frozen base's values (blake2b of its bytes), None without a base: a
        resumed run checks by it that it trains on the base it started from."""
        if not self.base:
            return None
        digest = hashlib.blake2b(digest_size=16)
        for name in sorted(self.base):
            digest.update(name.encode())
            for chunk in self.base[name].detach().view(torch.uint8).split(1 << 26):  # 64 MiB on the host at a time
                digest.update(chunk.cpu().numpy())
        return digest.hexdigest()

    @staticmethod
    def _place_base(
        frozen: list[tuple[str, torch.Tensor]], holders: dict, device: torch.device, base: dict | None
    ) -> dict[str, torch.Tensor]:
        """The base, one flat tensor per dtype (the server's: built from the module's own tensors,
        which are then dropped), and the module's frozen tensors as views of it."""
        sizes: dict[str, int] = {}
        for _, t in frozen:
            sizes[str(t.dtype)] = sizes.get(str(t.dtype), 0) + t.numel()
        created = base is None
        if created:
            dtypes = {str(t.dtype): t.dtype for _, t in frozen}
            base = {name: torch.empty(size, dtype=dtypes[name], device=device) for name, size in sizes.items()}
        elif {name: t.numel() for name, t in base.items()} != sizes:
            raise ValueError("the shared base does not match this model's frozen tensors")
        offsets = dict.fromkeys(sizes, 0)
        for _, t in frozen:
            key, n = str(t.dtype), t.numel()
            view = base[key][offsets[key] : offsets[key] + n].view(t.shape)
            if created:
                view.copy_(t.detach())  # the server's own values, into the base
            _install(holders[id(t)], view, False)
            offsets[key] += n
        return base

    @property
    def params(self) -> torch.Tensor:
        """The trainable part of ``flat`` (buffers excluded)."""
        return self.flat[: self.num_params]

    def __len__(self) -> int:
        return self.flat.numel()
