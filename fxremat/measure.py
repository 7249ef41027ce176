"""Measure the peak memory of a call: :func:`measure_peak`.

On CUDA the allocator's own statistics are used. On CPU and under ``FakeTensorMode`` a
``TorchDispatchMode`` tracks live storages: every op output's storage is counted once, and
subtracted when its Python storage object dies (storage objects are preserved by PyTorch, so a
weak reference fires at the real free). This measures GPU-scale memory on a CPU-only machine
when the model and inputs are fake tensors.
"""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .core import Timeline

__all__ = ["LiveStorageTracker", "AllocatorPeak", "measure_peak", "allocated_peak", "default_loss", "measure_timeline"]


class LiveStorageTracker(TorchDispatchMode):
    """Counts bytes of storages created inside the mode that are still alive.

    ``live_bytes`` is the running sum, ``peak_bytes`` its maximum; ``saw_cuda`` tells whether a
    real (non-fake) CUDA storage was created.
    """

    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.saw_cuda = False
        self._alive: dict[int, weakref.ref] = {}

    def _release(self, key: int, nbytes: int) -> None:
        if self._alive.pop(key, None) is not None:
            self.live_bytes -= nbytes

    def sizes_of(self, tensors) -> list[int]:
        """Bytes of each distinct storage among ``tensors`` that was allocated inside the mode
        and is still alive (views of older storages count 0)."""
        seen, sizes = set(), []
        for t in tensors:
            if t.layout != torch.strided:
                continue
            key = t.untyped_storage()._cdata
            if key in self._alive and key not in seen:
                seen.add(key)
                sizes.append(t.untyped_storage().nbytes())
        return sizes

    def track(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage once, until it is freed."""
        if tensor.layout != torch.strided:
            return
        self.track_storage(tensor.untyped_storage(), fake=isinstance(tensor, torch._subclasses.FakeTensor))

    def track_storage(self, storage: torch.UntypedStorage, fake: bool = False) -> None:
        """Count ``storage`` once, until it is freed (one allocated before the mode, which
        something else holds and lets go of inside it)."""
        key = storage._cdata
        if key in self._alive:
            return
        nbytes = storage.nbytes()
        self._alive[key] = weakref.ref(storage, lambda _r, k=key, n=nbytes: self._release(k, n))
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        if storage.device.type == "cuda" and not fake:
            self.saw_cuda = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output sharing storage with an input (views, in-place and out= ops) is not a new
        # allocation, even when that storage predates the tracker (parameters, inputs).
        inputs = {
            t.untyped_storage()._cdata
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor) and t.layout == torch.strided
        }
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                if t.untyped_storage()._cdata not in inputs:
                    self.track(t)
        return out


class AllocatorPeak:
    """The CUDA caching allocator's account of a block of code on ``device``: ``peak_bytes``, the
    most allocated above what was allocated on entry, and ``end_bytes``, what was allocated on exit
    above that (both stay 0 with ``device`` None: CPU, fake tensors).

    It sees what :class:`LiveStorageTracker` cannot: the workspaces cuDNN and cuBLAS take from the
    allocator inside an op (raw allocations, not tensors: a convolution's backward at batch 64 can
    take a hundred MiB for a moment). Entering resets the device's peak statistics
    (``torch.cuda.reset_peak_memory_stats``), as :func:`measure_peak` does."""

    def __init__(self, device: torch.device | None):
        self.device = device
        self.peak_bytes = self.end_bytes = 0
        self._base = 0

    def __enter__(self):
        if self.device is not None:
            torch.cuda.synchronize(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc):
        if self.device is not None:
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._base
            self.end_bytes = torch.cuda.memory_allocated(self.device) - self._base
        return False

    @property
    def transient_bytes(self) -> int:
        """What the block held for a moment beyond what it left allocated."""
        return max(0, self.peak_bytes - self.end_bytes)


def measure_peak(fn, *args, **kwargs):
    """Run ``fn(*args, **kwargs)`` and return ``(result, peak_bytes)``.

    ``peak_bytes`` is the most memory allocated during the call beyond what was live when it
    started. For a training step this is the activation peak (parameters, existing ``.grad``
    tensors and inputs allocated before the call are not counted).

    The call runs under a ``TorchDispatchMode`` (the live-storage tracker), and ``torch.compile``
    does not compile under one: code it meets there it marks to be skipped from then on, so one
    measured step left a compiled model eager for the rest of the process (a transformer stack
    under Inductor: 1.02x eager afterwards, 0.93x before). So ``torch.compile``'d code runs here
    as ``torch.compiler.set_stance("force_eager")`` runs it, and stays compiled; where ``fn`` or
    an argument is compiled (``torch.compile(m)``, ``m.compile()``, ``fxremat.compile(m, B,
    backend="inductor")``) a warning says that the peak is the eager step's, and that
    :func:`allocated_peak` measures the compiled one.

    >>> _, peak = measure_peak(lambda: torch.ones(1024, dtype=torch.float32) * 2)
    >>> peak
    8192
    """
    compiled = _compiled_parts(fn, args, kwargs)
    if compiled:
        warnings.warn(
            f"fxremat.measure_peak: {compiled[0]} is compiled with torch.compile; the peak is measured with it run "
            "eagerly (a dispatch-mode tracker: torch.compile would otherwise stop compiling it for good), so it is the "
            "eager step's, without the compiler's buffers or fusions. For the compiled step's peak use "
            "fxremat.measure.allocated_peak(fn, *args) (pass device= for CUDA).", stacklevel=2)
    use_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    allocator = AllocatorPeak(torch.device("cuda", torch.cuda.current_device()) if use_cuda else None)
    tracker = LiveStorageTracker()
    with torch.compiler.set_stance("force_eager"), allocator, tracker:
        result = fn(*args, **kwargs)
    return result, allocator.peak_bytes if use_cuda and tracker.saw_cuda else tracker.peak_bytes


def _compiled_parts(fn, args: tuple, kwargs: dict) -> list[str]:
    """What of ``fn`` and its arguments ``torch.compile`` compiled: compiled functions, modules
    wrapped by ``torch.compile(m)``, and modules (or submodules) compiled in place by
    ``m.compile()``, as ``"Name"`` or ``"Name.sub"``."""
    from torch._dynamo.eval_frame import OptimizedModule

    found = []
    objs, _ = tree_flatten((fn, getattr(fn, "__self__", None), args, kwargs))
    for obj in objs:
        if isinstance(obj, torch.nn.Module):
            for name, m in obj.named_modules():
                if isinstance(m, OptimizedModule) or getattr(m, "_compiled_call_impl", None) is not None:
                    found.append(type(obj).__name__ + (f".{name}" if name else ""))
        elif callable(obj) and hasattr(obj, "_torchdynamo_orig_callable"):
            found.append(getattr(obj, "__qualname__", repr(obj)))
    return found


def allocated_peak(fn, *args, device: torch.device | None = None) -> int:
    """The most bytes allocated during ``fn(*args)`` beyond what was allocated before, as the
    allocator sees them: on ``device`` (CUDA) the caching allocator's statistics
    (:class:`AllocatorPeak`); on the CPU the running sum of the profiler's allocation events.

    Unlike :func:`measure_peak` on the CPU it sees compiled code as it runs (Inductor's own
    buffers, op workspaces): a dispatch-mode tracker would make ``torch.compile`` run eagerly.
    """
    if device is not None and device.type == "cuda":
        with AllocatorPeak(device) as allocator:
            fn(*args)
        return allocator.peak_bytes
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(*args)
    live = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        live += nbytes
        peak = max(peak, live)
    return peak


def default_loss(out) -> torch.Tensor:
    """A cross-entropy against class 0 for every float output with a class dimension, a sum for
    other outputs (fxremat's prediction assumes a cross-entropy-like loss)."""
    parts = []
    for t in tree_flatten(out)[0]:
        if not isinstance(t, torch.Tensor) or not t.requires_grad:
            continue
        if t.is_floating_point() and t.dim() >= 2:
            target = torch.zeros(t.shape[0], *t.shape[2:], dtype=torch.long, device=t.device)
            parts.append(F.cross_entropy(t, target))
        else:
            parts.append(t.float().sum())
    if not parts:
        raise ValueError("fxremat: the model's output has no tensor that requires grad; nothing to backpropagate")
    return sum(parts[1:], parts[0])


class _TimelineTracker(LiveStorageTracker):
    def __init__(self):
        super().__init__()
        self.events: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.events.append(self.live_bytes)
        return out


def measure_timeline(model, *inputs, loss_fn=default_loss) -> Timeline:
    """Run one forward + backward of ``model`` and return the live bytes after every op.

    Parameters without ``.grad`` get a zero one first, so parameter gradients stay outside the
    measurement as they are outside the plan's budget; the backward accumulates into ``.grad``.
    """
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    tracker = _TimelineTracker()
    with tracker:
        loss = loss_fn(model(*inputs))
        start = len(tracker.events)
        loss.backward()
        del loss
    return Timeline(tuple(tracker.events), start)
