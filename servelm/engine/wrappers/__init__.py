"""Engines around another engine (engine/base.py's EngineWrapper): the waiting queue of admission (admission.py),
LoRA adapters held while a request runs (adapted.py), metering (metered.py) and tracing (traced.py)."""
