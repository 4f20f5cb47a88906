"""A check that every tensor the training step, the loss and the publisher work with lives on the
model's device.

`DeviceGuard(model_device, known=[model, optimizer, ...])` follows where each tensor came from while the
step runs, at two levels of torch:

- the function level (a TorchFunctionMode) sees each factory call (`torch.zeros`, `torch.tensor`,
  `torch.as_tensor`, `torch.arange`, ... the list torch's own `set_default_device` overrides) and marks
  its result *host* when the call names no device: on a GPU that tensor would be on the CPU. A `.to()`,
  `.cuda()` or `.cpu()` to the model's device marks its result *device* (on the CPU it returns the same
  object, so nothing happens at the operation level).
- the operation level (a TorchDispatchMode) sees every aten operation of the forward, the loss, the
  backward and the optimizer: an output is *host* when every tensor input is host, *device* otherwise.
  A tensor it has never seen with more than one element (`torch.from_numpy`, which no mode sees) is
  host; one it has never seen with a single element is a wrapped Python number and is ignored. The
  model's parameters, buffers, gradients and optimizer states are *device* from the start.

An operation whose inputs are host and device tensors together is recorded with the innermost frame of
this repository that called it: on a GPU it is a CPU tensor meeting a CUDA tensor (torch refuses it, or
for a 0-dim tensor hides a copy), on the CPU the same mistake that nothing else would show. Tensors
whose real devices differ are recorded too (a GPU run). Explicit transfers (`copy_`, `_to_copy`) are the
one legitimate way across. `check()` raises `DeviceMixError` naming every distinct (operation, line).
"""
from __future__ import annotations

import traceback
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

REPO = Path(__file__).resolve().parents[2]
_IN_PLACE = {"copy_", "_copy_from", "_copy_from_and_resize", "set_"}
_TRANSFERS = _IN_PLACE | {"_to_copy", "to", "lift_fresh", "lift_fresh_copy", "_pin_memory", "detach", "alias"}
_MOVES = {"to", "cuda", "cpu"}


class DeviceMixError(RuntimeError):
    """Tensors on the model's device met tensors created elsewhere."""


@dataclass(frozen=True)
class Mix:
    op: str
    where: str          # file:line of the innermost repository frame (else the innermost frame)

    def __str__(self) -> str:
        return f"{self.op} at {self.where}"


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-2]
              if "/torch/" not in f.filename and "/rl/doctor/guard" not in f.filename]
    ours = [f for f in frames if f.filename.startswith(str(REPO)) and "/.venv/" not in f.filename]
    f = (ours or frames or traceback.extract_stack())[-1]
    try:
        name = str(Path(f.filename).relative_to(REPO))
    except ValueError:
        name = f.filename
    return f"{name}:{f.lineno}"


def _tensors(obj, out: list) -> None:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _tensors(x, out)
    elif isinstance(obj, dict):
        for x in obj.values():
            _tensors(x, out)


def _constructors() -> set:
    try:
        from torch.utils._device import _device_constructors
        return set(_device_constructors())
    except ImportError:  # an older torch: the common ones
        return {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.tensor,
                torch.as_tensor, torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye}


class _Factories(TorchFunctionMode):
    def __init__(self, guard: "DeviceGuard"):
        super().__init__()
        self.guard = guard
        self.constructors = _constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        g = self.guard
        if func in self.constructors and isinstance(out, torch.Tensor):
            data = args[0] if args else kwargs.get("data")
            if kwargs.get("device") is None and not (isinstance(data, torch.Tensor) and not g.is_host(data)):
                g.status[out] = True
        elif getattr(func, "__name__", "") in _MOVES and isinstance(out, torch.Tensor) and args:
            dev = _target_device(func.__name__, args[1:], kwargs)
            if dev is not None and torch.device(dev).type == g.model_device:
                g.status[out] = False
        return out


def _target_device(name: str, args, kwargs):
    if name == "cuda":
        return "cuda"
    if name == "cpu":
        return "cpu"
    dev = kwargs.get("device")
    for a in args:
        if isinstance(a, (str, torch.device)):
            dev = a
        elif isinstance(a, torch.Tensor):
            dev = a.device
    return dev


class DeviceGuard(TorchDispatchMode):
    """with DeviceGuard(model_device, known=[model, optimizer]) as g: <step>; then g.check()."""

    def __init__(self, model_device: str | torch.device, known=()):
        super().__init__()
        self.model_device = torch.device(model_device).type
        self.status = WeakIdKeyDictionary()   # tensor -> True (host) / False (device)
        self.mixes: list[Mix] = []
        self.ops = 0
        self.counts: Counter = Counter()   # aten operation name -> calls (e.g. _scaled_mm)
        for k in known:
            self.register(k)
        self._factories = _Factories(self)

    def register(self, obj) -> None:
        """Mark the tensors of a module (parameters, buffers, gradients), an optimizer (its states) or a
        tensor as on the model's device."""
        found: list = []
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                found += [p] + ([p.grad] if p.grad is not None else [])
            found += list(obj.buffers())
        elif hasattr(obj, "state_dict") and hasattr(obj, "param_groups") or hasattr(obj, "optimizers"):
            for opt in getattr(obj, "optimizers", [obj]):
                for st in opt.state.values():
                    _tensors(st, found)
        else:
            _tensors(obj, found)
        for t in found:
            self.status[t] = False

    def is_host(self, t: torch.Tensor) -> bool:
        s = self.status.get(t)
        if s is None:  # never seen: from_numpy and friends (host), or a wrapped Python number
            return t.numel() > 1 or t.dim() > 0
        return s

    def __enter__(self):
        self._factories.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._factories.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        ins: list = []
        _tensors(args, ins)
        _tensors(kwargs, ins)
        name = func.overloadpacket.__name__
        self.counts[name] += 1
        host = [self.is_host(t) for t in ins]
        out = func(*args, **kwargs)
        if name in _TRANSFERS:
            if name in _IN_PLACE:   # writes into its first argument, which stays where it was
                return out
            dev = kwargs.get("device") if name in ("_to_copy", "to") else None
            outs: list = []
            _tensors(out, outs)
            for t in outs:  # sent to a named device, or (a dtype change, a detach) where its input was
                self.status[t] = (torch.device(dev).type != self.model_device if dev is not None
                                  else bool(host) and all(host))
            return out
        devices = {t.device.type for t in ins}
        mixed = (any(host) and not all(host)) or (len(devices) > 1 and self.model_device in devices)
        if mixed:
            self.mixes.append(Mix(str(func), _where()))
        outs = []
        _tensors(out, outs)
        is_host = bool(ins) and all(host)
        for t in outs:
            self.status[t] = is_host
        return out

    def distinct(self) -> list[Mix]:
        seen, out = set(), []
        for m in self.mixes:
            if (m.op, m.where) not in seen:
                seen.add((m.op, m.where))
                out.append(m)
        return out

    def check(self, what: str = "the step") -> None:
        d = self.distinct()
        if d:
            raise DeviceMixError(f"{what}: {len(d)} operation(s) mix tensors on the model's device "
                                 f"({self.model_device}) with tensors created without it: "
                                 + "; ".join(map(str, d[:6])))
