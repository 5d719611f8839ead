"""Orchestration infrastructure beside the asset graph: the dead-run watch that frees the
pool slots of runs killed without the daemon (`dead_runs`, `wiring`), the processes it
judges (`processes`), and every use of Dagster beyond its public API (`dagster_internals`).
It depends on Dagster, psutil and `common` only; `assets` wires it in."""
