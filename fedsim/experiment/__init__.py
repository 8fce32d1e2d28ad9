"""The experiment: its configuration dataclasses (``config.py``), components named in it by
registry name, import path or object (``components.py``), the checks of every section and of
what they say together (``validation.py``: ``load_config``), and the federation built from it
(``federation.py``: the dataset split among the clients, the initial model).

It may import fl, algorithms, data, results and core; execution, engine and runs import it.
"""
