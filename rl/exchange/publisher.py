"""Publishing weights without stopping the trainer for the disk.

Publishing has two halves: quantizing the live parameters to FP8 (must happen before the next optimizer
step changes them) and writing + fsyncing + renaming the shards (only touches the quantized copy).
`WeightPublisher` does the first on the caller's thread and hands the second to one background thread,
so the trainer step is blocked only by quantization; `wait()` joins the previous publish before the next
one starts (one in flight at most, so memory stays bounded and versions are published in order).
"""
from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Callable, Mapping

import torch

from rl import exchange
from rl.exchange.weights import quantize_state_dict, write_quantized


class WeightPublisher:
    def __init__(self, run_dir: str | Path, producer: str = "trainer", fp8_enabled: bool = True,
                 background: bool = True, on_published: Callable[[int], None] | None = None):
        self.run_dir = Path(run_dir)
        self.producer = producer
        self.fp8_enabled = fp8_enabled
        self.background = background
        self.on_published = on_published
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_blocked_s = 0.0
        self.last_write_s = 0.0

    def publish(self, version: int, hf_tensors: Mapping[str, torch.Tensor]) -> None:
        """Publish `weights/step_<version>`; returns once the parameters may change again."""
        t0 = time.perf_counter()
        self.wait()
        wire, quantized = quantize_state_dict(hf_tensors, self.fp8_enabled)

        def work():
            t1 = time.perf_counter()
            try:
                exchange.publish(self.run_dir, "weights", version,
                                 lambda d: write_quantized(d, wire, quantized), producer=self.producer,
                                 policy_version=version)
                if self.on_published is not None:
                    self.on_published(version)
            except BaseException as e:  # re-raised on the trainer's thread at the next wait()
                self._error = e
            self.last_write_s = time.perf_counter() - t1

        if self.background:
            self._thread = threading.Thread(target=work, name=f"publish-weights-{version}", daemon=True)
            self._thread.start()
        else:
            work()
            self._raise()
        self.last_blocked_s = time.perf_counter() - t0

    def _raise(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError(f"publishing weights failed: {e}") from e

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()
