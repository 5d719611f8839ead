"""Pure domain logic: no Dagster, no storage. Each module holds one concern."""
