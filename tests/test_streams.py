"""Random streams (fedsim.core.streams): every (stream, keys) pair hashes a word list of its own."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

from fedsim.core import streams


def fingerprint(drawn) -> int:
    """A 63-bit number from what a stream builder returns, taken from its SeedSequence the way
    ``torch_seed`` takes it, so that two builders on one SeedSequence give one fingerprint."""
    if isinstance(drawn, int):
        return drawn
    if isinstance(drawn, np.random.Generator):
        state = drawn.bit_generator.seed_seq.generate_state(2, np.uint64)
        return int(state[0] >> np.uint64(1))
    return drawn.initial_seed()  # a torch.Generator


SEEDS = [0, 1, 2, 5, 2**32, 2**32 + 5, 2**63 - 1]
SMALL = [0, 1, 2, 3, 7]

BUILDERS = {  # name: (builder, the keys it takes after the seed)
    "client": (streams.client_seed, 2),
    "group": (streams.group_seed, 2),
    "model": (streams.model_seed, 0),
    "attack noise": (streams.attack_generator, 1),
    "privacy noise": (streams.privacy_noise_generator, 1),
    "partition": (streams.partition_rng, 0),
    "attackers": (streams.attackers_rng, 0),
    "test split": (streams.test_split_rng, 0),
    "eval subset": (streams.eval_subset_rng, 0),
    **{
        name: (functools.partial(streams.generator, tag), count)
        for name, tag, count in [
            ("sampling", streams.SAMPLING, 1),
            ("online", streams.ONLINE, 1),
            ("dropout", streams.DROPOUT, 1),
            ("availability", streams.AVAILABILITY, 0),
            ("speed", streams.SPEED, 0),
        ]
    },
}


def test_a_seed_sequence_pads_with_zeros_and_splits_large_integers():
    """Why keys are not handed to numpy as they are: these lists are one stream to it."""

    def state(entropy):
        return np.random.SeedSequence(entropy).generate_state(4).tolist()

    assert state([3, 5, 0]) == state([3, 5])
    assert state([2**32 + 5, 7]) == state([5, 1, 7])


def test_the_word_list_is_the_tag_two_words_per_key_and_the_length():
    assert streams.words(streams.CLIENT, 3, 5, 0) == [streams.CLIENT, 3, 0, 5, 0, 0, 0, 8]
    assert streams.words(streams.MODEL, 2**32 + 5) == [streams.MODEL, 5, 1, 4]
    assert streams.words(streams.SAMPLING, 2**64 - 1, 2) == [streams.SAMPLING, 2**32 - 1, 2**32 - 1, 2, 0, 6]


def test_keys_ending_in_zero_give_streams_of_their_own():
    # each pair was one SeedSequence when streams were the keys themselves: trailing zeros dropped,
    # a tag equal to a key, a round or client id equal to a tag
    for seed, rnd in itertools.product(SEEDS, range(1, 6)):
        assert streams.group_seed(seed, rnd, 0) != streams.client_seed(seed, rnd, 3)
        assert streams.client_seed(seed, rnd, 0) not in {streams.client_seed(seed, rnd, c) for c in range(1, 10)}
        assert fingerprint(streams.test_split_rng(seed)) != streams.client_seed(seed, 1, 0)
        assert fingerprint(streams.attackers_rng(seed)) != streams.client_seed(seed, 7, 0)


def test_no_two_streams_share_a_seed_sequence():
    """Every builder over a grid of seeds and small keys (zeros, tag values, a seed spread over
    two words): all fingerprints distinct."""
    seen = {}
    for name, (build, count) in BUILDERS.items():
        for seed, keys in itertools.product(SEEDS, itertools.product(SMALL, repeat=count)):
            value = fingerprint(build(seed, *keys))
            assert value not in seen, f"{name}{(seed, *keys)} is {seen.get(value)}"
            seen[value] = f"{name}{(seed, *keys)}"
    assert len(seen) == sum(len(SEEDS) * len(SMALL) ** count for _, count in BUILDERS.values())


def test_the_same_keys_give_the_same_numbers():
    a, b = streams.generator(streams.ONLINE, 4, 9), streams.generator(streams.ONLINE, 4, 9)
    np.testing.assert_array_equal(a.random(20), b.random(20))
    assert streams.client_seed(4, 9, 2) == streams.client_seed(4, 9, 2)


@pytest.mark.parametrize(
    "tag, keys, words",
    [
        (streams.CLIENT, (3, 5), "takes 2 keys after the seed, got 1"),
        (streams.MODEL, (3, 1), "takes 0 keys after the seed, got 1"),
        (streams.SAMPLING, (-1, 2), "[0, 2^64), got -1"),
        (streams.SAMPLING, (2**64, 2), "[0, 2^64)"),
    ],
)
def test_bad_keys_are_refused(tag, keys, words):
    with pytest.raises(ValueError) as info:
        streams.words(tag, *keys)
    assert words in str(info.value)
