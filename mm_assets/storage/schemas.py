"""Arrow schemas of every table the pipeline writes, in one place."""

from __future__ import annotations

import pyarrow as pa

RAW_DATASET = pa.schema(
    [
        ("source_index", pa.int64()),
        ("record", pa.string()),  # the record's JSON text (or the raw line when unparseable)
        ("parse_error", pa.string()),
        ("source_file", pa.string()),  # the file the row came from (None: not known)
    ]
)

IMAGE_AVAILABILITY = pa.schema(
    [
        ("reference", pa.string()),
        ("path", pa.string()),
        ("status", pa.string()),
        ("detail", pa.string()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("format", pa.string()),
        ("bytes", pa.int64()),
        ("content_hash", pa.string()),
        ("referenced_by", pa.int32()),
    ]
)

NORMALIZED = pa.schema(
    [
        ("sample_id", pa.string()),
        ("source_index", pa.int64()),
        ("turns", pa.string()),  # JSON: the normalized form
        ("multimodal", pa.bool_()),
        ("image_paths", pa.list_(pa.string())),
        ("image_hashes", pa.list_(pa.string())),
        ("image_heights", pa.list_(pa.int32())),
        ("image_widths", pa.list_(pa.int32())),
        ("category", pa.string()),  # a benchmark row's category; null for training rows
    ]
)

# The conversations training reads: the normalized ones, with every assistant turn
# rewritten by the target (`responses: target`) or as the dataset wrote it (`dataset`).
TARGET_RESPONSES = pa.schema(
    [
        *NORMALIZED,
        ("responses", pa.string()),  # "target" or "dataset"
        ("response_key", pa.string()),  # content key of the stored replies (target only)
        ("reply_turns", pa.list_(pa.int32())),  # index of each regenerated turn
        ("reply_token_ids", pa.list_(pa.list_(pa.int32()))),  # what the target generated
        ("finish_reasons", pa.list_(pa.string())),
    ]
)

QUARANTINE = pa.schema(
    [
        ("source_index", pa.int64()),
        ("sample_id", pa.string()),
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("record", pa.string()),
    ]
)

TOKENIZED = pa.schema(
    [
        ("row_id", pa.string()),  # sample_id, or sample_id/turnN when a row per turn
        ("sample_id", pa.string()),
        ("source_index", pa.int64()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("seq_len", pa.int32()),
        ("num_supervised", pa.int32()),
        ("truncated", pa.bool_()),
        ("multimodal", pa.bool_()),
        ("messages", pa.string()),  # JSON, vLLM chat form; null for text-only rows
        ("image_hashes", pa.list_(pa.string())),
        # the target's position of each token where not 0..n-1 (M-RoPE image rows)
        ("position_ids", pa.list_(pa.int32())),
    ]
)

TOKEN_FREQUENCIES = pa.schema([("token_id", pa.int32()), ("count", pa.int64())])

MANIFEST = pa.schema(
    [
        ("row_id", pa.string()),
        ("sample_id", pa.string()),
        ("blob_key", pa.string()),
        ("path", pa.string()),  # relative to the storage root (`TableStore.resolve`)
        ("num_tokens", pa.int32()),
        ("bytes", pa.int64()),
        ("layer_ids", pa.list_(pa.int32())),
        ("layer_convention", pa.string()),
        ("dtype", pa.string()),
        ("hidden_size", pa.int32()),
        ("target_fingerprint", pa.string()),
        ("storage_dtype", pa.string()),  # native, bf16, fp8_e4m3
        ("final_layer", pa.string()),  # all, needed
        ("max_rel_error", pa.list_(pa.float32())),  # per layer, decoded vs received
    ]
)

REJECTIONS = pa.schema([("row_id", pa.string()), ("reason", pa.string()), ("detail", pa.string())])

# One row per draft x benchmark x category (and "overall") x method (eagle3, ngram, none):
# the sums of its requests (`SPECULATOR_BENCHMARK_PROMPTS`). Kept across measurements.
SPECULATOR_BENCHMARKS = pa.schema(
    [
        ("draft", pa.string()),
        ("benchmark", pa.string()),
        ("category", pa.string()),
        ("method", pa.string()),  # eagle3 (the draft), ngram, none (no speculation)
        ("speculative_tokens", pa.int32()),  # the depth it ran at (null for none)
        ("status", pa.string()),  # ok, or why the method did not run
        ("prompts", pa.int32()),
        ("requests", pa.int32()),
        ("output_tokens", pa.int64()),
        ("acceptance_length", pa.float64()),
        ("per_position_acceptance", pa.list_(pa.float64())),
        ("drafts", pa.int64()),
        ("output_tokens_per_s", pa.float64()),  # per request: tokens / its e2e latency
        ("time_per_output_token_ms", pa.float64()),
        ("speedup", pa.float64()),  # output_tokens_per_s / no speculation's, same category
        # 95% bootstrap intervals over the row's prompts (`prompts` of them): resampled
        # conversations; the speed-up paired with no speculation's on the same ones
        ("acceptance_low", pa.float64()),
        ("acceptance_high", pa.float64()),
        ("output_tokens_per_s_low", pa.float64()),
        ("output_tokens_per_s_high", pa.float64()),
        ("speedup_low", pa.float64()),
        ("speedup_high", pa.float64()),
        ("lossless", pa.int32()),  # requests whose greedy output equals no speculation's
        ("compared", pa.int32()),
        ("max_tokens", pa.int32()),
        ("concurrency", pa.int32()),
        ("target_fingerprint", pa.string()),
        ("draft_sha256", pa.string()),
        ("measured_at", pa.timestamp("s", tz="UTC")),
        ("measurement", pa.string()),  # same draft, benchmark and settings: same key
    ]
)

# The requests behind `speculator_benchmarks`, one row each: what every figure and
# interval there is computed from (docs/benchmarking.md says how they combine).
SPECULATOR_BENCHMARK_PROMPTS = pa.schema(
    [
        ("draft", pa.string()),
        ("benchmark", pa.string()),
        ("category", pa.string()),
        ("method", pa.string()),
        ("conversation", pa.int32()),  # its index in the category: the resampled unit
        ("round", pa.int32()),  # the user turn it answers
        ("output_tokens", pa.int32()),
        ("latency_s", pa.float64()),  # sent to answered, as the client waited
        ("decode_s", pa.float64()),  # vLLM: first output token to last
        ("drafts", pa.int32()),  # verifications of a proposal
        ("accepted", pa.int32()),
        ("accepted_per_position", pa.list_(pa.int32())),
        ("lossless", pa.bool_()),  # equal to no speculation's output (null for none)
        ("speculative_tokens", pa.int32()),  # the depth it ran at (null for none)
        ("beside", pa.string()),  # none sent in turn with this method (its speed-up's pair)
        ("measured_at", pa.timestamp("s", tz="UTC")),
        ("measurement", pa.string()),
    ]
)

# A draft served in vLLM on its sources' held-out prompts (`trained_speculator`,
# `trained_draft` with `measure_in_vllm`): one row per draft served and source.
DRAFT_MEASUREMENTS = pa.schema(
    [
        ("draft", pa.string()),  # the draft whose held-out prompts these are
        ("served", pa.string()),  # trained, untrained, or another draft's name
        ("source", pa.string()),  # whose held-out prompts; "overall": all of them
        ("prompts", pa.int32()),
        ("drafts", pa.int64()),
        ("accepted", pa.int64()),
        ("acceptance_length", pa.float64()),
        # its 95% bootstrap interval over the prompts (each reply's own counts)
        ("acceptance_low", pa.float64()),
        ("acceptance_high", pa.float64()),
        ("per_position_acceptance", pa.list_(pa.float64())),
        ("acceptance_length_estimate", pa.float64()),  # offline replay, same replies
        ("lossless", pa.int32()),  # generations equal to the target's own reply
        ("speculative_tokens", pa.int32()),
        ("max_tokens", pa.int32()),
        ("target_fingerprint", pa.string()),
        ("served_sha256", pa.string()),
        ("measured_at", pa.timestamp("s", tz="UTC")),
        ("measurement", pa.string()),  # same draft weights and settings: same key
    ]
)
