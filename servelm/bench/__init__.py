"""`servelm bench`: load, vLLM's serving metrics, the figure, and the named workloads; a client of any server."""
