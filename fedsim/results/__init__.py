"""What a run leaves and how it is read back: what each round records (``records.py``: the
columns of metrics.csv and clients.csv), the run directory's files (``rundir.py``), which keys
tell runs apart (``keys.py``), runs loaded as Histories and compared (``history.py``), plots
(``plot.py``) and the round line (``progress.py``). It may import core only, so reading runs back
needs neither torch nor the features; every layer above may import it.

``fedsim.results.load_run`` and the other names below keep their public path.
"""

from .history import History, group_repeats, load_run, load_runs, mean_and_sd, rounds_to_target
from .table import results_table

__all__ = ["History", "group_repeats", "load_run", "load_runs", "mean_and_sd", "results_table", "rounds_to_target"]
