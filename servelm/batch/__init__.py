"""The Files and Batches API and offline batch runs: state (store.py), lines (lines.py), the runner (runner.py)."""
