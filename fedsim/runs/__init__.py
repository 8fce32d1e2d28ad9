"""Runs: starting and resuming one (``launch.py``: ``fedsim.run``, ``fedsim.resume``, the CLI's
run on every rank), the run itself (``session.py``: parts assembled, the rounds' files,
checkpoints, the round line, interrupts), sweeps (``sweep.py``, ``sweepdir.py``), callbacks, and
a trained model loaded back (``trained.py``).

The top layer under the commands: it may import every layer below (execution, engine,
experiment, fl, algorithms, models, data, results, core); nothing below imports it.
"""
