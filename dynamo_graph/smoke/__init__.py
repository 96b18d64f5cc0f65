"""`dyngraph test`: a graph file as a CI smoke test.

A room of its own, above `graph/` (cli -> smoke -> graph): it brings a graph up through the
graph layer's supervisor (`graph.targets.local.daemon.supervise`, exactly what `dyngraph up` runs),
then talks HTTP to the graph's frontend like a client would. `graph/` knows nothing about HTTP
(docs/architecture.md), so the requests, expectations and reports cannot live there; they need nothing
from the serving rooms below either, only the public HTTP API.
"""
