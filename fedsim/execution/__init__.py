"""Executors: the ways a round's clients are trained (see engine/loop.py's Executor).

pool.py      a pool of worker processes (``workers: N``), or the server itself (``workers: 0``)
runner.py    what a worker does with its share of a round
hogwild.py   ``mode: hogwild``: the workers train the shared global weights in place
ranks.py     several ranks: wraps one of the above on every rank (over distributed.py,
             rendezvous.py)
launcher.py  fedsim run --ranks: starts the ranks (as torchrun would) and ends as rank 0 did
processes.py the fork server the workers are forked from; interrupts.py, resources.py

How a client trains is not here but in algorithms/local.py: this folder holds processes, ranks
and their plumbing.
"""
