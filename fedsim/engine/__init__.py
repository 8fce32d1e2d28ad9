"""The engine: one round at a time (loop.py; an async run's, one server update at a time, in
async_loop.py), the state kept between rounds (state.py), how the clients' work becomes the new
global model (update.py), and the buffers the round shares with the workers (buffers.py). What a
round records is results/records.py's.

It may import experiment, fl, algorithms, models, data, results and core; execution and runs
import it.
"""
