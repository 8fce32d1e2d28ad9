"""The base every layer stands on: errors and their one-line messages, the validation helper
(``checks.Checks``), registries, the random streams every draw comes from, flat parameter
buffers, YAML reading and the overrides written on top of it, and how a config section is
declared (``sections.py``). It imports nothing of fedsim's but itself.
"""
