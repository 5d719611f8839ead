"""Run every benchmark once and print their results as JSON (`make bench`)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import encoder_blocks, raw_memory, tokenize_lazy_vs_pixels, tokenize_memory, train_speed


def main() -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["tokenize_lazy_vs_pixels"] = tokenize_lazy_vs_pixels.run(300, Path(tmp) / "speed")
        results["tokenize_memory"] = tokenize_memory.run(Path(tmp) / "memory")
        results["raw_memory"] = raw_memory.run(Path(tmp) / "raw")  # ~1.3 GB of sources
        (Path(tmp) / "train").mkdir()
        results["train_speed"] = train_speed.run(Path(tmp) / "train")
    results["encoder_blocks"] = encoder_blocks.run()
    # fresh processes: each sets its own homes and datasets before mm_assets is imported
    for name in (
        "hidden_states_throughput",
        "regeneration_throughput",
        "cached_rerun",
        "cli_overhead",
        "hidden_state_storage",  # on the demo home: after `make demo`
        "omp_blocktime",  # likewise
    ):
        out = subprocess.run(
            [sys.executable, "-m", f"bench.{name}"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).resolve().parents[1],
        ).stdout
        results[name] = json.loads(out[out.index("{") :])
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
