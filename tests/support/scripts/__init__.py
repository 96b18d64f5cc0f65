"""Programs the tests start as processes (workers) or load as engine files (`out=pytok:FILE`);
tests name them by path, never import them."""

from pathlib import Path

SCRIPTS = Path(__file__).parent
