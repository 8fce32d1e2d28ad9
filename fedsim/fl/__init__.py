"""The federated-learning features of the server and the simulated population, one module each
with its own configuration section and checks: aggregation rules, server optimizers, attacks,
compression, differential privacy and its accounting, the asynchronous methods (FedBuff,
FedAsync), system heterogeneity and client sampling, the state clients keep, and per-client
evaluation. What is trained (models, LoRA adapters, losses) is models/'s; how a client trains,
algorithms/'s.

A feature may import the others in this folder, algorithms, models, data, results and core.
Checks that relate one feature to another live in ``experiment/validation.py``, not here.
"""
