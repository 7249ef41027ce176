"""Colossal-AI's chain rotor checkpoint solver as a peer row (issue 15), on CPU with torch 2.x.

:func:`rotor_module` runs Colossal-AI's own pipeline for ``CheckpointSolverRotor``, the one its
docstrings and tests use: ``colossalai.fx.ColoTracer`` traces the model into a
``ColoGraphModule``, ``colossalai.fx.metainfo_trace`` (``MetaInfoProp`` over ``MetaTensor``)
profiles every node on the meta device, ``CheckpointSolverRotor(...).solve(force_python=True)``
linearizes the graph into a chain, runs the rotor dynamic programme and annotates the nodes, and
Colossal-AI's ``ActivationCheckpointCodeGen`` emits the forward with (nested) checkpoint
functions that call ``colossalai.utils.activation_checkpoint.checkpoint``. The module returned
is that GraphModule, running Colossal-AI's emitted code and its checkpoint function.

It needs Colossal-AI in its own venv (its pinned requirements, ``torch<=2.5.1``, transformers
4.51, ..., do not install beside torch 2.13); see :data:`VENV_SETUP`.

What Colossal-AI's rotor models, read from ``ckpt_solver_base.py`` / ``ckpt_solver_rotor.py``:

- ``free_memory`` is the whole memory in bytes; the solver first takes off
  ``parameter bytes * (optim_multiplier + 1)`` (the weights and the optimizer's extra copy,
  ``optim_multiplier=1.0`` by default) and plans activations in what is left, discretized into
  ``memory_slots`` (500) slots. :func:`rotor_module` takes an *activation* budget and passes
  ``free_memory = budget_bytes + parameter bytes * (optim_multiplier + 1)``, so the rotor plans
  exactly ``budget_bytes`` of activations. The chain's input would count as ``x[0]``, but the meta
  profiler records no output for a placeholder, so it is 0: the input, like the parameters and
  their gradients, is outside the budget (as in ``fxremat.measure_peak`` with ``with_grads``).
- Stage sizes: a stage's output ``x`` is the part of it that the next nodes *save for backward*
  (``calculate_fwd_out``: their ``fwd_in``), so an output whose consumer saves only its own
  output (ReLU, softmax) counts 0, and ``xbar`` adds the stage's saved temporaries.
- Stage costs: each chain stage costs ``sum over its nodes of max(fwd_time, 1.0)`` (and likewise
  backward). The meta profiler records FLOPs but leaves ``fwd_time``/``bwd_time`` at 0 (only
  its CUDA ``_profile_concrete`` path times nodes), so on CPU every node costs 1: the plan
  minimizes the *number of recomputed graph nodes*, not their time (uniform costs).
- The chain: ``_linearize_graph`` cuts the graph where every earlier value is dead (so a
  residual block is one stage); a graph with long skips (a U-Net) becomes one or a few stages.

Patches, applied by monkeypatching when this module is imported (site-packages is not edited):

1. ``ActivationCheckpointCodeGen._gen_python_code`` (``colossalai.fx.codegen``) takes only
   ``verbose``; torch 2.x's ``Graph.python_code`` passes new keyword arguments
   (``include_stride``, ``include_device``, ``colored``, ``expanded_def``, ``record_func``,
   ``additional_meta``). Wrapped to drop them.
2. The emitted code calls ``colossalai.utils.activation_checkpoint.checkpoint``; that module
   moved to ``colossalai.legacy.utils.activation_checkpoint``. Aliased back (attribute on
   ``colossalai.utils`` and a ``sys.modules`` entry).
3. CUDA RNG: that checkpoint function saves/restores the CPU RNG itself, and also calls the
   legacy seed manager's ``sync_states`` (``torch.cuda.get_rng_state()``, which fails without
   CUDA, then stores it under the current parallel mode, which is ``None`` unless
   ``colossalai.launch`` registered seeds) and ``set_mode(None)`` (a ``KeyError``). In that
   module's namespace both become no-ops while no parallel mode is set; with seeds registered
   they are the originals.
4. FLOP table: ``colossalai.fx.profiler.opcount.flop_mapping`` is only filled for torch
   1.12-1.x (``{}`` on 2.x) and the meta profiler indexes it for every aten op, so profiling
   fails with a ``KeyError`` on the first op. The profiler's table is replaced with the same
   op -> counter entries (those ops that still exist in this torch, plus torch 2.x's batch-norm
   names), defaulting to 0 FLOPs for others (recorded in :data:`UNCOUNTED_OPS`). FLOPs do not
   reach the rotor chain (see the costs above); this patch only lets the profile run.

Not patched: the Chen solver's ``super().__init__(graph, 0, 0, True, cnode)`` passes its
arguments in the wrong order (``requires_linearize=0``, ``cnode=True``); only the rotor solver
is used here. The rotor's C table (``_compute_table_c``) is not used: the sdist/wheel does not
ship ``ckpt_solver_rotor.c`` and its fallback would try to build into site-packages, so
``solve(force_python=True)`` runs the Python table (seconds for a 20-stage chain at 500 slots).

Side effects of Colossal-AI itself: its codegen registers ``colossalai`` in torch.fx's global
``_custom_builtins``; ``MetaInfoProp`` sets ``.grad = None`` on the model's parameters; the
checkpointed forward is recomputed in backward without restoring BatchNorm running statistics
(they are updated once more per recomputation, as with ``torch.utils.checkpoint``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings

import torch
import torch.nn as nn

__all__ = ["rotor_module", "installed", "VENV_SETUP", "UNCOUNTED_OPS"]

VENV_SETUP = (
    "python3 -m venv venv-cai && venv-cai/bin/pip install torch==2.13.0 && "
    "venv-cai/bin/pip install --no-deps colossalai==0.5.0 && "
    "venv-cai/bin/pip install psutil numpy packaging tqdm einops peft galore_torch networkx"
)

UNCOUNTED_OPS: set = set()

_import_error: BaseException | None = None


def _import_colossalai():
    """Import the parts of Colossal-AI used here, quietly (it warns about apex and bitsandbytes
    kernels on import)."""
    quiet = io.StringIO()
    with warnings.catch_warnings(), contextlib.redirect_stdout(quiet):
        warnings.simplefilter("ignore")
        logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
        import colossalai  # noqa: F401
        import colossalai.auto_parallel.checkpoint  # noqa: F401
        import colossalai.fx  # noqa: F401
        import colossalai.fx.codegen.activation_checkpoint_codegen  # noqa: F401
        import colossalai.fx.profiler.opcount  # noqa: F401
        import colossalai.fx.profiler.profiler  # noqa: F401
        import colossalai.legacy.utils.activation_checkpoint  # noqa: F401
        import colossalai.utils  # noqa: F401 (its attribute is set below)


try:
    _import_colossalai()
except Exception as exc:  # ImportError, or a dependency failing on import
    _import_error = exc


def installed() -> bool:
    """Whether Colossal-AI imports in this interpreter (patches applied)."""
    return _import_error is None


# --- patches -----------------------------------------------------------------------------------

def _patch_codegen():
    from colossalai.fx.codegen import activation_checkpoint_codegen as codegen

    cls = codegen.ActivationCheckpointCodeGen
    original = cls._gen_python_code
    if getattr(original, "_fxremat_patched", False):
        return

    def _gen_python_code(self, nodes, root_module, namespace, *, verbose=None, **_newer_torch_kwargs):
        return original(self, nodes, root_module, namespace, verbose=verbose)

    _gen_python_code._fxremat_patched = True
    cls._gen_python_code = _gen_python_code


def _patch_checkpoint_module():
    import colossalai.utils
    from colossalai.legacy.utils import activation_checkpoint as ckpt

    colossalai.utils.activation_checkpoint = ckpt
    sys.modules.setdefault("colossalai.utils.activation_checkpoint", ckpt)

    if getattr(ckpt.sync_states, "_fxremat_patched", False):
        return
    original_sync, original_set_mode = ckpt.sync_states, ckpt.set_mode

    def sync_states():
        if ckpt.get_current_mode() is None:
            return  # no parallel seeds registered: nothing to sync, and no CUDA RNG to read
        original_sync()

    def set_mode(parallel_mode):
        if parallel_mode is None:
            return
        original_set_mode(parallel_mode)

    sync_states._fxremat_patched = True
    ckpt.sync_states, ckpt.set_mode = sync_states, set_mode


class _FlopTable(dict):
    """A FLOP table that counts 0 for an op it lacks (and records it)."""

    def __missing__(self, op):
        UNCOUNTED_OPS.add(str(op))
        return _zero_flops


def _zero_flops(*_args):
    return 0


def _flop_table() -> _FlopTable:
    from colossalai.fx.profiler import opcount as oc

    aten = torch.ops.aten
    table = _FlopTable()

    def put(names, counter):
        for name in names:
            packet, _, overload = name.partition(".")
            op = getattr(getattr(aten, packet, None), overload or "default", None)
            if op is not None:
                table[op] = counter

    put(["mm", "mv", "dot", "matmul"], oc.matmul_flop_jit)
    put(["addmm"], oc.addmm_flop_jit)
    put(["bmm"], oc.bmm_flop_jit)
    put(["baddbmm"], oc.baddbmm_flop_jit)
    put(["convolution", "_convolution"], oc.conv_flop_jit)
    put(["convolution_backward"], oc.conv_backward_flop_jit)
    put(["native_batch_norm", "native_batch_norm_backward", "cudnn_batch_norm"], oc.batchnorm_flop_jit)
    put(["cudnn_batch_norm_backward"], lambda i, o: oc.batchnorm_flop_jit(i, o, training=True))
    # torch 2.x batch-norm ops (training forward; no-update forward; the shared backward)
    put(["_native_batch_norm_legit", "_native_batch_norm_legit_functional", "_batch_norm_with_update",
         "_batch_norm_with_update_functional", "batch_norm_backward"], oc.norm_flop_counter(1, 0))
    put(["_native_batch_norm_legit_no_training", "_batch_norm_no_update"],
        lambda i, o: oc.batchnorm_flop_jit(i, o, training=False))
    put(["native_layer_norm", "native_layer_norm_backward", "native_group_norm",
         "native_group_norm_backward"], oc.norm_flop_counter(2, 0))
    put(["avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d",
         "max_pool1d_with_indices", "max_pool2d_with_indices", "max_pool3d_with_indices",
         "_adaptive_avg_pool2d", "_adaptive_avg_pool3d", "embedding"], oc.elementwise_flop_counter(1, 0))
    put(["avg_pool2d_backward", "avg_pool3d_backward", "max_pool2d_with_indices_backward",
         "max_pool3d_with_indices_backward", "_adaptive_avg_pool2d_backward", "_adaptive_avg_pool3d_backward",
         "embedding_dense_backward", "upsample_nearest2d.vec", "upsample_nearest2d_backward.vec"],
        oc.elementwise_flop_counter(0, 1))
    put(["add.Tensor", "add_.Tensor", "div.Tensor", "div_.Tensor", "div.Scalar", "div_.Scalar", "mul.Tensor",
         "mul.Scalar", "mul_.Tensor", "neg", "pow.Tensor_Scalar", "rsub.Scalar", "sum", "sum.dim_IntList",
         "mean.dim", "sub.Tensor", "sub_.Tensor", "exp", "sin", "cos", "hardswish", "hardswish_",
         "hardswish_backward", "hardtanh", "hardtanh_", "hardtanh_backward", "hardsigmoid_backward",
         "hardsigmoid", "gelu", "gelu_backward", "silu", "silu_", "silu_backward", "sigmoid",
         "sigmoid_backward", "_softmax", "_softmax_backward_data", "relu_", "relu", "tanh", "tanh_backward",
         "threshold_backward", "native_dropout", "native_dropout_backward"], oc.elementwise_flop_counter(1, 0))
    put(["as_strided", "as_strided_", "bernoulli_.float", "cat", "clone", "copy_", "detach", "expand",
         "empty_like", "new_empty", "new_empty_strided", "ones_like", "_reshape_alias", "select.int",
         "select_backward", "squeeze.dim", "slice.Tensor", "slice_backward", "stack", "split.Tensor", "permute",
         "t", "transpose.int", "_to_copy", "unsqueeze", "unbind.int", "_unsafe_view", "view", "where.self",
         "zero_", "zeros_like", "fill_.Scalar"], _zero_flops)
    return table


def _patch_flop_table():
    from colossalai.fx.profiler import opcount, profiler

    if isinstance(profiler.flop_mapping, _FlopTable):
        return
    if profiler.flop_mapping:  # torch 1.x: Colossal-AI's own table is in place
        return
    table = _flop_table()
    opcount.flop_mapping = table
    profiler.flop_mapping = table
    sys.modules["colossalai.fx.profiler"].flop_mapping = table


if _import_error is None:
    _patch_codegen()
    _patch_checkpoint_module()
    _patch_flop_table()


# --- the peer ----------------------------------------------------------------------------------

def _parameter_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def rotor_module(model: nn.Module, example_input: torch.Tensor, budget_bytes: int, *,
                 memory_slots: int = 500, optim_multiplier: float = 1.0) -> torch.nn.Module:
    """Colossal-AI's rotor plan for ``model`` on ``example_input`` within ``budget_bytes`` of
    activation memory: its traced GraphModule with its emitted checkpoint code.

    ``budget_bytes`` is the memory the rotor may use for the chain's input and activations;
    Colossal-AI's ``free_memory`` is the whole memory, from which it takes off the parameters
    times ``optim_multiplier + 1``, so it is given ``budget_bytes`` plus that. The returned module
    shares ``model``'s parameters and buffers (as a ``torch.fx.GraphModule`` does) and takes the
    same single tensor input. Raises ``ValueError`` where the rotor finds no schedule within the
    budget (Colossal-AI raises a bare ``ValueError`` after logging a warning), ``ImportError``
    without Colossal-AI.
    """
    if _import_error is not None:
        raise ImportError(
            f"Colossal-AI is not importable here ({type(_import_error).__name__}: {_import_error}); "
            f"it runs in its own venv: {VENV_SETUP}; then run with venv-cai/bin/python "
            f"and PYTHONPATH set to the repository root"
        ) from _import_error

    from colossalai.auto_parallel.checkpoint import CheckpointSolverRotor
    from colossalai.fx import ColoGraphModule, ColoTracer, metainfo_trace

    graph = ColoTracer(trace_act_ckpt=False).trace(model)
    gm = ColoGraphModule(model, graph, type(model).__name__)
    metainfo_trace(gm, example_input)

    free_memory = budget_bytes + _parameter_bytes(model) * (optim_multiplier + 1)
    solver = CheckpointSolverRotor(gm.graph, free_memory=free_memory, memory_slots=memory_slots,
                                   optim_multiplier=optim_multiplier)
    try:
        gm.graph = solver.solve(force_python=True)
    except ValueError as exc:
        raise ValueError(f"Colossal-AI's rotor found no schedule for {type(model).__name__} within "
                         f"{budget_bytes} activation bytes ({len(solver.chain)}-stage chain)") from exc
    gm.recompile()
    gm.colossal_chain_length = len(solver.chain)
    gm.colossal_sequence = solver.sequence
    return gm
