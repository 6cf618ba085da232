"""The content-filter pipeline: a deployment's policy as data (policy.py), its term lists (blocklist.py), its guard
model (guard.py) and each request's screening of prompts and answers (content_filter.py)."""
