"""`bench/gpu_check.py` is run only when a GPU machine is lent, so it must not rot here:
the same code at a tiny width on the CPU trains (the loss falls) and round-trips states."""

from __future__ import annotations

from bench import gpu_check


def test_the_gpu_check_runs_at_a_tiny_width_on_the_cpu() -> None:
    tiny = {"hidden": 64, "heads": 4, "vocab": 2048, "draft_vocab": 512, "tokens": 512}
    first = gpu_check.trainer_speed(**tiny, steps=1, device="cpu")
    later = gpu_check.trainer_speed(**tiny, steps=8, device="cpu")
    assert later["tokens_per_batch"] == 512 and later["tokens_per_s"] > 0
    assert later["final_loss"] < first["final_loss"]  # the same batch, more steps
    codec = gpu_check.codec_speed(64, 300, rounds=1)
    assert codec["bytes_vs_bf16_layout"] < 0.5  # fp8 with the last layer where needed
    assert max(codec["max_rel_error"]) < 0.07
