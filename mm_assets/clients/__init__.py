"""Clients of external systems: the vLLM server (managed or external) and its connector."""
