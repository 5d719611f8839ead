"""Orchestration beside the asset graph: the dead-run watch, which frees the pool slots of
runs killed without the daemon. It depends on Dagster, psutil and `common` only."""
