"""The base every layer stands on: errors and their one-line messages, the validation helper
(``checks.Checks``), registries, the random streams every draw comes from, flat parameter
buffers, and YAML reading. It imports nothing of fedsim's but itself.
"""
