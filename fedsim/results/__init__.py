"""What a run leaves and how it is read back: the run directory's files (``rundir.py``), runs
loaded as Histories and compared (``history.py``), plots (``plot.py``) and the round line
(``progress.py``). It may import core only.

``fedsim.results.load_run`` and the other names below keep their public path.
"""

from .history import History, group_repeats, load_run, load_runs, mean_and_sd, results_table, rounds_to_target

__all__ = ["History", "group_repeats", "load_run", "load_runs", "mean_and_sd", "results_table", "rounds_to_target"]
