"""A hidden-states KV connector for vLLM's CPU engine, loaded by name through
`kv_connector_module_path`.

vLLM's `ExampleHiddenStatesConnector` copies hidden states to pinned host memory on a
CUDA stream, which crashes a CPU-only build on the first request. This subclass copies
synchronously and keeps the rest (file names, the `.lock` protocol, the pooled write).
"""

from __future__ import annotations

import fcntl
import os
from functools import partial
from types import SimpleNamespace

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets.reshape(1, -1) + block_ids.reshape(-1, 1) * self._block_size).flatten()
        hidden = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
        tensors = {
            "hidden_states": hidden.contiguous().clone(),
            "token_ids": pending.token_ids.clone(),
        }
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        # in place of the copy's CUDA event: the copy above has finished already
        done = SimpleNamespace(query=lambda: True, synchronize=lambda: None)
        future = self._executor.submit(
            self._write_tensors, tensors, done, pending.filename, lock_fd
        )
        self._req_copy_events[pending.req_id] = done  # type: ignore[assignment]
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
