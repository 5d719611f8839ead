"""Pure logic by stage — `ingest/` (sources, images), `prep/` (conversations,
tokenization), `model/` (hidden-state rules, EAGLE-3 model, trainer, checkpoint format) —
plus row ids and rejections shared by the stages. No Dagster, no storage, no clients,
no servers: each module is tested on its own (the import contract in pyproject.toml)."""
