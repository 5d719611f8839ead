"""Dagster wiring: the assets and their checks, resources, partitions, automation and
schedules. An asset reads its config and resources, calls one service, and renders the
service's report as metadata and check results. Services are imported inside the asset
bodies: they bring torch and transformers, which loading the code location should not."""
