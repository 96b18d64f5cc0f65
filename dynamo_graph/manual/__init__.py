"""The pages of the manual (docs/) that are generated from the code, so they cannot go stale:
graph keys, metrics, error types, the engine matrix of the README and the benchmark table.
`python -m dynamo_graph.manual` rewrites them; `--check` lists the stale ones (CI, tests).
"""
