"""Every random choice of a run, and the keys that keep its streams apart.

A stream is seeded from the run's seed and keys that say what it is for (a round, a client, a
vmap group), never from a process's history: the same keys give the same numbers in any worker,
rank or resumed process, which is why results do not depend on the number of workers and a
resumed run continues exactly. The partition and the initial model draw from ``seed`` itself.
"""
from __future__ import annotations

import numpy as np
import torch

# keys of the streams that are not a client's own (seed, round, client) stream
SAMPLING = 1  # which clients a round samples
ATTACK_NOISE = 2  # the noise the gaussian attack sends
VMAP_GROUP = 3  # dropout and augmentation of a vmap group
ATTACKERS = 7  # which clients are Byzantine
TEST_SPLIT = 1  # the per-client test split (a stream of its own: its seed list differs in length)
# simulated system heterogeneity (system.py): every such stream starts (seed, SYSTEM, purpose, ...);
# SYSTEM ("SYST" in ASCII) is never the second key of the streams above
SYSTEM = 0x53595354
ONLINE = 1  # (seed, SYSTEM, ONLINE, round): who is online this round
DROPOUT = 2  # (seed, SYSTEM, DROPOUT, round): who fails before reporting this round
AVAILABILITY = 3  # (seed, SYSTEM, AVAILABILITY): each client's availability probability, drawn once
SPEED = 4  # (seed, SYSTEM, SPEED): each client's relative speed, drawn once
# DP-FedAvg's noise (privacy.py): (seed, round, PRIVACY_NOISE), a third key above every client id
# (data.num_clients <= 1e8), so never a client's (seed, round, client) stream; and not 0, which
# numpy's SeedSequence would drop as a trailing key
PRIVACY_NOISE = 2**32 - 1
# a client's compressed update (compression.py): (seed, round, client, COMPRESSION), a fourth key
# above every first slot of a vmap group, so never group_seed's stream
COMPRESSION = 2**32 - 2


def derive_seed(*keys: int) -> int:
    """A 63-bit seed from integer keys, e.g. (seed, round, client)."""
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def client_seed(seed: int, rnd: int, client: int) -> int:
    """A client's shuffling, dropout and augmentation in one round."""
    return derive_seed(seed, rnd, client)


def group_seed(seed: int, rnd: int, first_slot: int) -> int:
    """Dropout and augmentation of the vmap group that starts at ``first_slot``."""
    return derive_seed(seed, rnd, VMAP_GROUP, first_slot)


def attack_generator(seed: int, rnd: int) -> torch.Generator:
    return torch.Generator().manual_seed(derive_seed(seed, ATTACK_NOISE, rnd))


def privacy_noise_generator(seed: int, rnd: int) -> torch.Generator:
    """Round ``rnd``'s privacy noise: a CPU generator, so that the noise is the same on any device,
    in any process, and after a resume."""
    return torch.Generator().manual_seed(derive_seed(seed, rnd, PRIVACY_NOISE))


def compression_generator(seed: int, rnd: int, client: int) -> torch.Generator:
    """The random rounding of ``client``'s update in round ``rnd``: a CPU generator, so that it is
    the same on any device, in any process, and after a resume."""
    return torch.Generator().manual_seed(derive_seed(seed, rnd, client, COMPRESSION))


def attackers_rng(seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, ATTACKERS])


def test_split_rng(seed: int) -> np.random.Generator:
    return np.random.default_rng([seed, TEST_SPLIT])
