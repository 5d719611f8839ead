"""The work that touches engines and storage — loading datasets into tables, probing
images, tokenizing, running vLLM for hidden states and measurements, assembling training
data and reuse records. Each entry point returns a plain report (a dataclass) that the
Dagster assets render; nothing here imports Dagster."""
