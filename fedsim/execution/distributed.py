"""Several ranks: one process per device, each with its own worker pool, started by
``fedsim run --ranks`` (launcher.py) or torchrun, joined as rendezvous.py says.

    fedsim run FILE --ranks G [--nodes N --node-rank I --rendezvous HOST:PORT] [--set ...]

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

Besides the collectives, the ranks share the rendezvous store: there each rank says that it
joined (where it runs) and, as it leaves, how it ended. A signal stops each rank wherever it is,
so after one the ranks are no longer at the same collective and none is started; a rank whose
collective fails because a peer left reads from the store whether that peer ended or died.
"""

from __future__ import annotations

import datetime
import functools
import os
import re
import socket
import time
from typing import TYPE_CHECKING, Any

import torch

from ..core.errors import FedsimError
from .interrupts import Terminated
from .rendezvous import (
    launch_numbers,
    launcher_gone,
    meet,
    ranks_named,
    read,
    rendezvous_seconds,
    store_key,
    watch_launcher,
)

if TYPE_CHECKING:
    from ..engine.buffers import RoundBuffers

LOST_PEER_GRACE_SECONDS = 3.0  # see Ranks.lost: only a failing job ever waits it


class RankStopped(FedsimError):
    """This rank stops because another reported the failure (and printed it)."""

    exit_code = 1


class RankLost(FedsimError):
    """A rank of the job died or stopped answering: a failure of the job, not of its input."""

    exit_code = 1


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

    @property
    def several(self) -> bool:
        """Whether the run has other ranks to talk to (torchrun); a single process has none."""
        return self.world > 1

    @classmethod
    def join(cls, timeout_seconds: float = 1800.0) -> Ranks:
        """Join the job (torchrun's, or ranks started by hand with RANK, WORLD_SIZE, MASTER_ADDR and
        MASTER_PORT): meet the other ranks within the rendezvous bound, then a gloo group for
        everything at first, whose collectives wait at most ``timeout_seconds``."""
        import torch.distributed as dist

        ranks = cls()
        ranks.rank, ranks.world = launch_numbers()
        ranks.agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # else rank 0 hosts it
        ranks.store = meet(ranks.rank, ranks.world, rendezvous_seconds(), ranks.agent_store)
        ranks.identities = [read(ranks.store, store_key("joined", r)).split()[:2] for r in range(ranks.world)]
        ranks.identities = [(host, int(pid)) for host, pid in ranks.identities]
        ranks._collective(
            lambda: dist.init_process_group(
                "gloo",
                store=ranks.store,
                rank=ranks.rank,
                world_size=ranks.world,
                timeout=datetime.timedelta(seconds=timeout_seconds),
            ),
            "joining",
        )
        watch_launcher()
        return ranks

    def use_device(self, device: torch.device) -> None:
        """Tensors go over NCCL when every rank drives a GPU of its own, else over gloo."""
        if not self.several:
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
        return all_groups[self.rank :: self.world]

    def agree(self, error: str | None, what: str) -> None:
        """Every rank says whether its part went well; if one did not, every rank stops: the
        one that failed with its message (rank 0 prints it), the others quietly."""
        if not self.several:
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

    def gather_rows(self, buffers: RoundBuffers, groups: list[list[int]], what: str) -> None:
        """Rank 0's round buffers receive every rank's trained rows: weights, stats, reports."""
        if not self.several:
            return
        import torch.distributed as dist

        def pack(slots):
            parts = [buffers.client_weights[slots], buffers.stats[slots]]
            parts += [
                r[slots].reshape(len(slots), -1).to(buffers.client_weights.dtype) for r in buffers.reports.values()
            ]
            return torch.cat(parts, dim=1)

        mine = [s for group in self.groups(groups) for s in group]
        per_rank = [[s for g in groups[r :: self.world] for s in g] for r in range(self.world)]
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
        buffers.stats[slots] = rows[:, p : p + width]
        offset = p + width
        for report in buffers.reports.values():
            size = report[0].numel()
            report[slots] = rows[:, offset : offset + size].reshape(len(slots), *report.shape[1:]).to(report.dtype)
            offset += size

    def share(self, tensors: list[torch.Tensor], what: str) -> None:
        """Rank 0's values of ``tensors`` on every rank (in place)."""
        if not self.several:
            return
        import torch.distributed as dist

        for tensor in tensors:
            staged = self._out(tensor.contiguous())
            self._collective(functools.partial(dist.broadcast, staged, 0, group=self.data_group), what)
            if staged is not tensor:
                tensor.copy_(staged)

    def decide(self, value: Any, what: str) -> Any:
        """Rank 0's ``value`` (any small picklable object) on every rank."""
        if not self.several:
            return value
        import torch.distributed as dist

        box = [value]
        self._collective(lambda: dist.broadcast_object_list(box, 0), what)
        return box[0]

    def collect(self, value: Any, what: str) -> list | None:
        """Every rank's ``value``, in rank order, on rank 0 (None elsewhere)."""
        if not self.several:
            return [value]
        import torch.distributed as dist

        values = [None] * self.world if self.is_root else None
        self._collective(lambda: dist.gather_object(value, values, dst=0), what)
        return values

    def close(self, ending: str = "finished") -> None:
        """Leave the job, first saying how this rank ended ("finished", "was interrupted",
        "failed"): the others' collectives fail once it is gone, and they read this to tell a rank
        that ended from one that died."""
        if self.several:
            import torch.distributed as dist

            if self._store_up():
                try:
                    self.store.set(store_key("ended", self.rank), ending)
                except RuntimeError:
                    pass  # its host went in between
            if dist.is_initialized():
                dist.destroy_process_group()

    # ----------------------------------------------------------------- failures

    def _out(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.cpu() if self.via_host else tensor

    def _collective(self, call, what: str) -> None:
        """Run a collective; if a peer is gone, stop with one line naming it. A signal that came
        while this rank waited in the collective is handled by the first call made here (Python
        runs pending handlers then), so a peer that left on the same signal reads as the signal."""
        try:
            call()
        except RuntimeError as e:  # gloo and NCCL report a lost peer as RuntimeError (or a subclass)
            if launcher_gone():
                raise Terminated from None  # the same stop that watch_launcher is about to signal
            ended = self.ended()
            if ended:
                rank, how = min(ended.items())
                raise RankStopped(f"rank {rank} {how}; the job stopped" if self.is_root and rank else "") from None
            raise RankLost(self._gone(what, e)) from None

    def ended(self) -> dict[int, str]:
        """The other ranks that left the job saying how they ended (see ``close``)."""
        found = {}
        if not self._store_up():
            return found
        for rank in range(self.world):
            key = store_key("ended", rank)
            try:
                if rank != self.rank and self.store.check([key]):
                    found[rank] = read(self.store, key)
            except RuntimeError:
                break  # the store went with its host: nothing more to read
        return found

    def _store_up(self) -> bool:
        """Whether the store's host (torchrun's agent, or rank 0) is still there, as far as this
        machine can tell: c10d logs every failed store call on stderr."""
        if self.agent_store:
            return not launcher_gone()
        host, pid = self.identities[0]
        return self.is_root or host != socket.gethostname() or _alive(pid)

    def lost(self, grace: float = 0.0) -> list[int]:
        """The other ranks on this machine that are gone without saying how they ended: they died
        (ranks on other machines cannot be looked at from here). A killed process closes its
        sockets a moment before it is gone from the process table, and on a busy machine that
        moment can outlast the peer's reaction to the closed socket: wait up to ``grace`` seconds
        for one to be gone."""
        deadline, here = time.monotonic() + grace, socket.gethostname()
        while True:
            ended = self.ended()  # read again each time: a peer may say how it ended meanwhile
            peers = [
                (rank, pid)
                for rank, (host, pid) in enumerate(getattr(self, "identities", ()))
                if rank != self.rank and rank not in ended and host == here
            ]
            lost = [rank for rank, pid in peers if not _alive(pid)]
            if lost or not peers or time.monotonic() >= deadline:
                return lost
            time.sleep(0.05)

    def _gone(self, what: str, error: Exception) -> str:
        cause = _cause(error)
        lost = self.lost(grace=LOST_PEER_GRACE_SECONDS)
        if lost:
            return f"{ranks_named(lost)} died ({what} failed: {cause})"
        here = socket.gethostname()
        elsewhere = [rank for rank, (host, _) in enumerate(self.identities) if host != here]
        where = f"; ranks on other machines: {', '.join(map(str, elsewhere))}" if elsewhere else ""
        return f"a rank stopped answering ({what} failed: {cause}){where}; its launcher names a rank that died"


def _cause(error: Exception) -> str:
    """The first sentence of a gloo or NCCL error, without the source location it starts with
    ("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:7557")."""
    text = (str(error).strip().splitlines() or [""])[0]
    return re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0] or type(error).__name__


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
