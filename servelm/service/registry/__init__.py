"""The deployment registry and its lifecycle: the models this server serves by name (deployments.py), those that
come and go (catalog.py, the face of servelm/fleet.py) and each text deployment's LoRA adapters (adapters.py)."""
