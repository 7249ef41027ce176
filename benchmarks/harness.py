"""What every benchmark shares: the training step, timing, the machine set-up and the plot.

The scripts (``run``, ``chain``, ``compile_budget``, ``baselines``) import from here and from
:mod:`benchmarks.nets`; nothing here imports them. The machine a run uses (device, allocator,
output folder) is a :class:`Machine` value returned by :func:`set_up_machine` and passed on,
not a module global.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import pathlib
import platform
import sys
import time

import torch
import torch.nn.functional as F

ROOT = pathlib.Path(__file__).resolve().parents[1]
GIB, MIB = 2**30, 2**20


def loss_of(out):
    out = out.logits if hasattr(out, "logits") else out
    target = torch.zeros(out.shape[0], *out.shape[2:], dtype=torch.long, device=out.device)
    return F.cross_entropy(out, target)


def with_grads(model):
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    return model


def step(model, x):
    """One training step written the usual way: the output is held until the step ends."""
    out = model(x)
    loss_of(out).backward()
    return out


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(model, x, step_fn=step) -> float:
    """Seconds of one training step taken right after an untimed one. Variants are interleaved,
    and on CPU a step timed right after another variant's runs on the heap that variant left
    (freed or kept pages): measured here, that biased ratios by up to ±10% either way."""
    step_fn(model, x)
    synchronize(x.device)
    start = time.perf_counter()
    step_fn(model, x)
    synchronize(x.device)
    return time.perf_counter() - start


def load_average() -> str:
    return f"{os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else "n/a"


def caching_heap() -> str:
    """Make glibc keep freed memory in its heap, as a GPU caching allocator does; return a line
    that says what the allocator now is, for the results' header.

    By default glibc hands blocks above a dynamic threshold (128 KiB at start) back to the OS when
    they are freed, so every step page-faults its activations in again: step time then grows with
    the bytes a step allocates, which favours whatever keeps less memory (checkpointed variants
    measured up to 20% faster than plain here) and swings with the variant timed before.
    ``mallopt`` raises the mmap threshold to its 32 MiB maximum and stops heap trimming; peaks are
    unaffected (they are counted by the tracker)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return "system malloc (not glibc: freed memory may go back to the OS)"
    m_trim_threshold, m_mmap_threshold = -1, -3
    if libc.mallopt(m_mmap_threshold, 32 * MIB) and libc.mallopt(m_trim_threshold, 2**31 - 1):
        return "glibc heap kept (mallopt: mmap threshold 32 MiB, no trimming), like a caching allocator"
    return "system malloc (mallopt refused)"


@dataclasses.dataclass(frozen=True)
class Machine:
    """Where a benchmark's steps run and where its results go (from :func:`set_up_machine`)."""

    device: str
    allocator: str
    out: pathlib.Path
    script: str
    batch_scale: int = 1

    def shape(self, shape) -> tuple:
        """A net's input ``shape`` with its batch multiplied by ``--batch-scale`` (GPU-sized steps)."""
        return (shape[0] * self.batch_scale, *shape[1:])

    def environment(self) -> str:
        """The results' header: command, versions, threads, time, allocator, GPU."""
        return (f"Command: `python -m {self.script} {' '.join(sys.argv[1:])}`  \n"
                f"torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}, "
                f"{torch.get_num_threads()} threads, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  \n"
                f"CPU allocator: {self.allocator}"
                + (f"  \nbatch × {self.batch_scale} (`--batch-scale`)" if self.batch_scale != 1 else "")
                + (f"  \nGPU: {torch.cuda.get_device_name()}" if self.device == "cuda" else ""))


def add_machine_options(parser) -> None:
    """``--out``, ``--device``, ``--batch-scale``, ``--threads`` and ``--system-malloc``, shared by the
    scripts."""
    parser.add_argument("--out", default=None,
                        help="default benchmarks/results (benchmarks/results/cuda with --device cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the steps run; on cuda peaks come from torch.cuda.max_memory_allocated")
    parser.add_argument("--batch-scale", type=int, default=1,
                        help="multiply each net's batch (the nets are sized for a CPU: on a GPU their steps are "
                             "a few kernel launches each; 8 to 32 gives GPU-sized steps)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: on a shared 2-core machine a thread stalled by "
                             "another process stalls every parallel op)")
    parser.add_argument("--system-malloc", action="store_true",
                        help="leave glibc's malloc as it is (see caching_heap: step times then follow page faults)")


def set_up_machine(parser, args, script: str) -> Machine:
    """Apply :func:`add_machine_options`' options (``script`` is the module name for the header);
    the output folder is created."""
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False here; run on a machine with a GPU "
                     "and a CUDA build of torch, or leave --device at cpu")
    if args.device == "cuda":
        torch.cuda.init()  # measure_peak reads the CUDA allocator's statistics once CUDA is initialised
    default = ROOT / "benchmarks" / "results" / ("cuda" if args.device == "cuda" else "")
    out = pathlib.Path(args.out) if args.out else default
    allocator = "system malloc" if args.system_malloc else caching_heap()
    torch.set_num_threads(args.threads)
    out.mkdir(parents=True, exist_ok=True)
    if args.batch_scale < 1:
        parser.error(f"--batch-scale must be a positive integer, got {args.batch_scale}")
    return Machine(device=args.device, allocator=allocator, out=out, script=script, batch_scale=args.batch_scale)


def plot(rows, path, styles) -> bool:
    """Step time vs measured peak (the papers' Figure 3 style): a line per family in
    ``styles`` ((family, matplotlib format) pairs), a star for plain."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install matplotlib): no plot written")
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for family, style in styles:
        pts = sorted((r["peak"] / MIB, r["ratio"]) for r in rows if r["family"] == family)
        if pts:
            ax.plot(*zip(*pts), style, label=family, markersize=10 if family == "plain" else 6)
    ax.set_xlabel("measured peak (MiB)")
    ax.set_ylabel("step time / plain")
    ax.set_title(f"{rows[0]['net']}: memory vs time (CPU, median of interleaved steps)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
