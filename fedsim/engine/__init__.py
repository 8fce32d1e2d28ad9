"""The engine: one round at a time (loop.py; an async run's, one server update at a time, in
asynchronous.py), the state kept between rounds (state.py), how the clients' work becomes the new
global model (update.py), and what each round records."""
from .asynchronous import AsyncEngine
from .buffers import RoundBuffers
from .loop import Engine, Executor, RoundResult, evaluate
from .records import CLIENT_COLUMNS, ClientRecord
from .state import GlobalState
from .update import AggregateUpdates

__all__ = ["AggregateUpdates", "AsyncEngine", "CLIENT_COLUMNS", "ClientRecord", "Engine", "Executor", "GlobalState",
           "RoundBuffers", "RoundResult", "evaluate"]
