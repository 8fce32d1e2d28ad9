"""What is trained: the model zoo (zoo.py), language models (language.py: char_transformer and
``hf:`` causal LMs), LoRA adapters and the ``lora:`` section (lora.py), and the tasks' losses and
scores (tasks.py). ``from fedsim.models import MODELS`` gives the registry of every model by name.

It may import data, results and core; algorithms and everything above import it.
"""

from . import language  # noqa: F401  (registers char_transformer in MODELS)
from .zoo import MODELS, build_model

__all__ = ["MODELS", "build_model"]
