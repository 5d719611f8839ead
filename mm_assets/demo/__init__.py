"""Offline demo assets: synthetic chat datasets, a benchmark and tiny targets built locally
(the demo's own trained to answer questions about its pictures)."""
