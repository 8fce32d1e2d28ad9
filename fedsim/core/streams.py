"""Every random choice of a run, and the keys that keep its streams apart.

A stream is seeded from the run's seed and keys that say what it is for (a round, a client, a
vmap group), never from a process's history: the same keys give the same numbers in any worker,
rank or resumed process, which is why results do not depend on the number of workers and a
resumed run continues exactly.

How keys become a seed. numpy's ``SeedSequence`` hashes a list of 32-bit words, but a list of
integers does not name one word list: it pads a short list with zero words, so ``[s, r, 0]``
and ``[s, r]`` are one stream, and it spreads an integer of 2^32 or more over as many words as
it needs, so ``[2**32 + 5, 7]`` and ``[5, 1, 7]`` are one stream too. Every stream here is
therefore the word list

    [tag, seed_lo, seed_hi, key_lo, key_hi, ..., length]

``tag``: the stream's own nonzero number (below); the seed and every key, integers in
[0, 2^64), as exactly two words each, low word first; ``length``: the number of words in the
list, never 0. A tag takes a fixed number of keys, so two lists with the same first word have
the same length, and the last word is never a padding zero: different (stream, keys) give
different word lists, and only a collision of ``SeedSequence``'s 128-bit hash could give them
the same numbers. A new stream takes a new tag.
"""

from __future__ import annotations

import numpy as np
import torch

# tag: the stream, and the keys after the run's seed
PARTITION = 1  # (): the split of the training set among the clients
TEST_SPLIT = 2  # (): the per-client test split
MODEL = 3  # (): the initial model's weights
SAMPLING = 4  # (round): which clients a round samples
CLIENT = 5  # (round, client): a client's shuffling, dropout and augmentation in one round
VMAP_GROUP = 6  # (round, first slot): dropout and augmentation of a vmap group
ATTACKERS = 7  # (): which clients are Byzantine
ATTACK_NOISE = 8  # (round): the noise the gaussian attack sends
PRIVACY_NOISE = 9  # (round): DP-FedAvg's noise
ONLINE = 10  # (round): who is online (system.py)
DROPOUT = 11  # (round): who fails before reporting (system.py)
AVAILABILITY = 12  # (): each client's availability probability, drawn once (system.py)
SPEED = 13  # (): each client's relative speed, drawn once (system.py)
COMPRESSION = 14  # (round, client): the random rounding of a client's compressed update (compression.py)
ASYNC_START = 15  # (start): which client an async run's j-th start trains, and whether it drops out
EVAL_SUBSET = 16  # (): the test samples the rounds before the last are scored on (eval_subset)
POISSON_SIZES = 17  # (block): the sample sizes of a block of a poisson run's rounds (sampling.py)
LORA_RANKS = 18  # (): each client's LoRA rank, drawn once (models/lora.py)
LORA_INIT = 19  # (round, client): the fresh adapters a FLoRA client starts a round from
PRE_AGGREGATION = 20  # (round): the random buckets of the bucketing pre-aggregator
CLUSTER_INIT = 21  # (cluster): the initial weights of IFCA's cluster models after the first

_KEYS = {
    PARTITION: 0,
    TEST_SPLIT: 0,
    MODEL: 0,
    SAMPLING: 1,
    CLIENT: 2,
    VMAP_GROUP: 2,
    ATTACKERS: 0,
    ATTACK_NOISE: 1,
    PRIVACY_NOISE: 1,
    ONLINE: 1,
    DROPOUT: 1,
    AVAILABILITY: 0,
    SPEED: 0,
    COMPRESSION: 2,
    ASYNC_START: 1,
    EVAL_SUBSET: 0,
    POISSON_SIZES: 1,
    LORA_RANKS: 0,
    LORA_INIT: 2,
    PRE_AGGREGATION: 1,
    CLUSTER_INIT: 1,
}
_WORD = 2**32


def words(tag: int, seed: int, *keys: int) -> list[int]:
    """The word list of stream ``tag`` for the run's ``seed`` and the stream's keys."""
    if _KEYS.get(tag) != len(keys):
        raise ValueError(f"stream {tag} takes {_KEYS.get(tag)} keys after the seed, got {len(keys)}")
    out = [tag]
    for key in (seed, *keys):
        key = int(key)
        if not 0 <= key < _WORD**2:
            raise ValueError(f"stream keys are integers in [0, 2^64), got {key}")
        out += [key % _WORD, key // _WORD]
    return out + [len(out) + 1]


def generator(tag: int, seed: int, *keys: int) -> np.random.Generator:
    """A numpy generator on the stream."""
    return np.random.default_rng(np.random.SeedSequence(words(tag, seed, *keys)))


def torch_seed(tag: int, seed: int, *keys: int) -> int:
    """A 63-bit seed for torch's generators, from the stream."""
    state = np.random.SeedSequence(words(tag, seed, *keys)).generate_state(2, np.uint64)
    return int(state[0] >> np.uint64(1))


def client_seed(seed: int, rnd: int, client: int) -> int:
    """A client's shuffling, dropout and augmentation in one round (an async run's ``rnd`` is the
    client's start, see engine/async_loop.py)."""
    return torch_seed(CLIENT, seed, rnd, client)


def group_seed(seed: int, rnd: int, first_slot: int) -> int:
    """Dropout and augmentation of the vmap group that starts at ``first_slot``."""
    return torch_seed(VMAP_GROUP, seed, rnd, first_slot)


def model_seed(seed: int) -> int:
    return torch_seed(MODEL, seed)


def attack_generator(seed: int, rnd: int) -> torch.Generator:
    return torch.Generator().manual_seed(torch_seed(ATTACK_NOISE, seed, rnd))


def pre_aggregation_generator(seed: int, rnd: int) -> torch.Generator:
    """Round ``rnd``'s pre-aggregation draws (bucketing's order): a CPU generator, so that they are
    the same on any device, in any process, and after a resume."""
    return torch.Generator().manual_seed(torch_seed(PRE_AGGREGATION, seed, rnd))


def privacy_noise_generator(seed: int, rnd: int) -> torch.Generator:
    """Round ``rnd``'s privacy noise: a CPU generator, so that the noise is the same on any device,
    in any process, and after a resume."""
    return torch.Generator().manual_seed(torch_seed(PRIVACY_NOISE, seed, rnd))


def partition_rng(seed: int) -> np.random.Generator:
    return generator(PARTITION, seed)


def compression_generator(seed: int, rnd: int, client: int) -> torch.Generator:
    """The random rounding of ``client``'s update in round ``rnd``: a CPU generator, so that it is
    the same on any device, in any process, and after a resume."""
    return torch.Generator().manual_seed(torch_seed(COMPRESSION, seed, rnd, client))


def async_start_generator(seed: int, start: int) -> np.random.Generator:
    """An async run's ``start``-th start of a client: which client, and whether it drops out."""
    return generator(ASYNC_START, seed, start)


def attackers_rng(seed: int) -> np.random.Generator:
    return generator(ATTACKERS, seed)


def test_split_rng(seed: int) -> np.random.Generator:
    return generator(TEST_SPLIT, seed)


def eval_subset_rng(seed: int) -> np.random.Generator:
    return generator(EVAL_SUBSET, seed)
