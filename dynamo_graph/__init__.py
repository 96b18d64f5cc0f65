"""dyngraph: declarative LLM serving graphs with a dynamo-run compatible command line."""

__version__ = "0.1.0"
