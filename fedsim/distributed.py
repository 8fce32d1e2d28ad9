"""Several ranks: one process per device, launched by torchrun, each with its own worker pool.

    torchrun --nproc-per-node=G [--nnodes=N ...] -m fedsim run FILE [--set ...]

Every rank samples the round's clients from the same stream, and trains its share of them:
the round's slot groups (one slot each, or the vmap groups) are dealt to the ranks in turn,
group g to rank g mod R, and within a rank to its workers the same way. Each client is trained
exactly as in a single process (its randomness comes from (seed, round, client)), and rank 0
gathers every rank's rows into the same [k, P] stack, in the same slot order, that one process
would hold: so every rule, server optimizer and algorithm works unchanged, and the numbers do
not depend on the number of ranks. A gather is chosen over a reduction because robust rules
(median, Krum) need the rows themselves; the cost is k x P values to rank 0 each round.

Rank 0 then does what the single process does (update, evaluate, record, checkpoint) and sends
the new global weights, the algorithm's server state and the round's rows of its client state
back to every rank. Objects (the config, errors) travel over a gloo group; tensors over NCCL
when every rank has a GPU of its own, else over gloo through host memory.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch

from .errors import FedsimError


class RankStopped(FedsimError):
    """This rank stops because another reported the failure (and printed it)."""

    exit_code = 1


def launched() -> bool:
    """Whether this process is one of several ranks that torchrun started."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ


def rank_device(name: str) -> str:
    """The device of this rank: ``cuda`` (or ``auto`` with CUDA) becomes ``cuda:LOCAL_RANK``,
    shared in turn when there are fewer GPUs than ranks on a machine; others stay as given."""
    if name in ("auto", "cuda") and torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0)) % torch.cuda.device_count()}"
    return name


class Ranks:
    """This process's place among the ranks; a single process is rank 0 of 1 and nothing here
    communicates then."""

    def __init__(self):
        self.rank, self.world = 0, 1
        self.data_group = None
        self.via_host = True

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @classmethod
    def join(cls, timeout_seconds: float = 1800.0) -> "Ranks":
        """Join the job torchrun started (env:// rendezvous); a gloo group for everything at first."""
        import torch.distributed as dist

        ranks = cls()
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_seconds))
        ranks.rank, ranks.world = dist.get_rank(), dist.get_world_size()
        ranks._store_identity()
        return ranks

    def use_device(self, device: torch.device) -> None:
        """Tensors go over NCCL when every rank drives a GPU of its own, else over gloo."""
        if self.world == 1:
            return
        import torch.distributed as dist

        devices = [None] * self.world
        dist.all_gather_object(devices, (socket.gethostname(), str(device)))
        own_gpus = device.type == "cuda" and len(set(devices)) == self.world and dist.is_nccl_available()
        if own_gpus:
            self.data_group, self.via_host = dist.new_group(backend="nccl"), False

    # ----------------------------------------------------------------- the round

    def groups(self, all_groups: list[list[int]]) -> list[list[int]]:
        """This rank's share of the round's slot groups."""
        return all_groups[self.rank::self.world]

    def agree(self, error: str | None, what: str) -> None:
        """Every rank says whether its part went well; if one did not, every rank stops: the
        one that failed with its message (rank 0 prints it), the others quietly."""
        if self.world == 1:
            if error:
                raise FedsimError(error)
            return
        import torch.distributed as dist

        errors = [None] * self.world
        self._collective(lambda: dist.all_gather_object(errors, error), what)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            rank, message = failed[0]
            if self.is_root:
                raise FedsimError(f"rank {rank}: {message}" if rank else message)
            raise RankStopped("")

    def gather_rows(self, buffers, groups: list[list[int]], what: str) -> None:
        """Rank 0's round buffers receive every rank's trained rows: weights, stats, reports."""
        if self.world == 1:
            return
        import torch.distributed as dist

        def pack(slots):
            parts = [buffers.client_weights[slots], buffers.stats[slots]]
            parts += [r[slots].reshape(len(slots), -1).to(buffers.client_weights.dtype) for r in buffers.reports.values()]
            return torch.cat(parts, dim=1)

        mine = [s for group in self.groups(groups) for s in group]
        per_rank = [[s for g in groups[r::self.world] for s in g] for r in range(self.world)]
        longest = max(len(p) for p in per_rank)
        width = pack(mine[:1] or [0]).shape[1]
        send = torch.zeros(longest, width, device=buffers.client_weights.device)
        if mine:
            send[: len(mine)] = pack(mine)
        send = self._out(send)
        received = [torch.empty_like(send) for _ in range(self.world)] if self.is_root else None
        self._collective(lambda: dist.gather(send, received, dst=0, group=self.data_group), what)
        if self.is_root:
            for rank, slots in enumerate(per_rank):
                if rank and slots:
                    self._unpack(buffers, slots, received[rank][: len(slots)].to(buffers.client_weights.device))

    @staticmethod
    def _unpack(buffers, slots, rows) -> None:
        p = buffers.client_weights.shape[1]
        buffers.client_weights[slots] = rows[:, :p]
        width = buffers.stats.shape[1]
        buffers.stats[slots] = rows[:, p:p + width]
        offset = p + width
        for report in buffers.reports.values():
            size = report[0].numel()
            report[slots] = rows[:, offset:offset + size].reshape(len(slots), *report.shape[1:]).to(report.dtype)
            offset += size

    def share(self, tensors: list[torch.Tensor], what: str) -> None:
        """Rank 0's values of ``tensors`` on every rank (in place)."""
        if self.world == 1:
            return
        import torch.distributed as dist

        for tensor in tensors:
            staged = self._out(tensor.contiguous())
            self._collective(lambda: dist.broadcast(staged, 0, group=self.data_group), what)
            if staged is not tensor:
                tensor.copy_(staged)

    def decide(self, value, what: str):
        """Rank 0's ``value`` (any small picklable object) on every rank."""
        if self.world == 1:
            return value
        import torch.distributed as dist

        box = [value]
        self._collective(lambda: dist.broadcast_object_list(box, 0), what)
        return box[0]

    def collect(self, value, what: str) -> list:
        """Every rank's ``value``, in rank order, on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        values = [None] * self.world if self.is_root else None
        self._collective(lambda: dist.gather_object(value, values, dst=0), what)
        return values

    def close(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()

    # ----------------------------------------------------------------- failures

    def _out(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.cpu() if self.via_host else tensor

    def _collective(self, call, what: str) -> None:
        """Run a collective; if a peer is gone, stop with one line naming it."""
        try:
            call()
        except RuntimeError as e:  # gloo and NCCL report a lost peer as RuntimeError (or a subclass)
            raise FedsimError(self._gone(what, e)) from None

    def _store_identity(self) -> None:
        """Where each rank runs, so that a lost one can be named."""
        import torch.distributed as dist

        self.identities = [None] * self.world
        dist.all_gather_object(self.identities, (socket.gethostname(), os.getpid()))

    def lost(self) -> list[int]:
        """The other ranks on this machine that are no longer alive (ranks on other machines
        cannot be looked at from here)."""
        here = socket.gethostname()
        return [rank for rank, (host, pid) in enumerate(getattr(self, "identities", ()))
                if rank != self.rank and host == here and not _alive(pid)]

    def _gone(self, what: str, error: Exception) -> str:
        cause = str(error).split("]")[-1].strip().split(". ")[0] or type(error).__name__
        lost = self.lost()
        if lost:
            return f"{ranks_named(lost)} died ({what} failed: {cause})"
        here = socket.gethostname()
        elsewhere = [rank for rank, (host, _) in enumerate(self.identities) if host != here]
        where = f"; ranks on other machines: {', '.join(map(str, elsewhere))}" if elsewhere else ""
        return f"a rank stopped answering ({what} failed: {cause}){where}; torchrun's report names it"


def ranks_named(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
