"""The federated-learning features, one module each with its own configuration section and
checks: aggregation rules, server optimizers, attacks, compression, differential privacy, the
asynchronous methods, system heterogeneity and client sampling, the state clients keep, per-client
evaluation, and the registered models.

A feature may import the others in this folder, algorithms, data, results and core. Checks that
relate one feature to another live in ``experiment/validation.py``, not here.
"""
