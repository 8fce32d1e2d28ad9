"""The engine: one round at a time (loop.py; an async run's, one server update at a time, in
asynchronous.py), the state kept between rounds (state.py), how the clients' work becomes the new
global model (update.py), what each round records (records.py), and the buffers the round shares
with the workers (buffers.py).

It may import experiment, fl, algorithms, data and core; execution, results and runs import it.
The package imports none of its modules, so that reading a run's columns (records.py) does not
import torch.
"""
