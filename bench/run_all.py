"""Run every benchmark once and print their results as JSON (`make bench`)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from bench import tokenize_lazy_vs_pixels, tokenize_memory


def main() -> None:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        results["tokenize_lazy_vs_pixels"] = tokenize_lazy_vs_pixels.run(300, Path(tmp) / "speed")
        results["tokenize_memory"] = tokenize_memory.run(Path(tmp) / "memory")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
