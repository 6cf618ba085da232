"""End-to-end tests: a real `servelm serve` subprocess on the embedded model, driven by the official
`openai` client (and raw httpx where the client hides the wire)."""
