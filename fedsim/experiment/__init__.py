"""The experiment: its top-level keys and the sections gathered into one ``Config`` (``config.py``;
each section is declared beside its feature), components named in it by
registry name, import path or object (``components.py``), the checks of every section and of
what they say together (``validation.py``: ``load_config``), and the federation built from it
(``federation.py``: the dataset split among the clients, the initial model).

It may import fl, algorithms, models, data, results and core; engine, execution and runs import it.
"""
