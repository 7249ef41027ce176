"""Issue 13 items 1, 2, 4: hooks, a model compiled in eval(), changing input shapes — as in eager."""

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxremat
from _models import assert_same_state, pair, with_grads


class Net(nn.Module):
    def __init__(self, c=8, n=4):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.Dropout(0.2))
            for _ in range(n))
        self.head = nn.Conv2d(c, 4, 1)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x) + x
        return self.head(x)


def _step(model, x, seed=0):
    torch.manual_seed(seed)
    out = model(x)
    F.cross_entropy(out, torch.zeros(out.shape[0], *out.shape[2:], dtype=torch.long)).backward()
    return out.detach()


X = (2, 3, 16, 16)


def _compiled(model, **kw):
    return fxremat.compile(model, "min", example_inputs=(torch.randn(*X),), cost_model="flops", **kw)


# ---------------------------------------------------------------- item 1: hooks


def test_forward_hook_removed_after_compiling_no_longer_runs():
    torch.manual_seed(0)
    plain, model = pair(Net())
    scale = lambda m, i, o: o * 3  # noqa: E731
    handles = [m.blocks[1].register_forward_hook(scale) for m in (plain, model)]
    compiled = _compiled(model)
    x = torch.randn(*X)
    assert torch.equal(_step(plain, x), _step(compiled, x))
    assert_same_state(plain, compiled)
    for h in handles:
        h.remove()
    assert torch.equal(_step(plain, x, 1), _step(compiled, x, 1))
    assert_same_state(plain, compiled)


def test_pre_hooks_and_feature_hooks_fire_in_compiled_steps_not_in_profiling():
    torch.manual_seed(0)
    plain, model = pair(Net())
    features = {"plain": [], "compiled": []}
    pre_calls = {"plain": 0, "compiled": 0}

    def hooks_for(tag):
        def pre(m, args):
            pre_calls[tag] += 1

        def feat(m, i, o):
            features[tag].append(o.detach().clone())
        return pre, feat

    for tag, m in (("plain", plain), ("compiled", model)):
        pre, feat = hooks_for(tag)
        m.blocks[2].register_forward_pre_hook(pre)
        m.blocks[2].register_forward_hook(feat)
    compiled = fxremat.compile(model, "min", example_inputs=(torch.randn(*X),))  # measured profile
    assert pre_calls["compiled"] == 0 and features["compiled"] == []  # profiling fired no hook
    x = torch.randn(*X)
    assert torch.equal(_step(plain, x), _step(compiled, x))
    assert_same_state(plain, compiled)
    assert pre_calls["plain"] == 1 and features["plain"]
    # the forward ran the hooks once; recomputation (torch.utils.checkpoint) may run them again
    assert pre_calls["compiled"] >= 1
    assert torch.equal(features["plain"][0], features["compiled"][0])


def test_hook_added_after_compiling_runs_and_global_hook():
    torch.manual_seed(0)
    plain, model = pair(Net())
    compiled = _compiled(model)
    x = torch.randn(*X)
    _step(plain, x), _step(compiled, x)
    double = lambda m, i, o: o * 2  # noqa: E731
    for m in (plain, compiled):
        m.blocks[0].register_forward_hook(double)
    assert torch.equal(_step(plain, x, 1), _step(compiled, x, 1))
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, i, o: seen.append(type(m).__name__) if isinstance(m, nn.BatchNorm2d) else None)
    try:
        assert torch.equal(_step(plain, x, 2), _step(compiled, x, 2))
        assert seen.count("BatchNorm2d") >= 8  # 4 from plain, at least 4 from compiled
    finally:
        handle.remove()
    assert torch.equal(_step(plain, x, 3), _step(compiled, x, 3))
    assert_same_state(plain, compiled)


def test_the_module_tree_is_walked_again_only_when_a_hook_could_have_come(monkeypatch):
    """A training step looks for new hooks without walking the module tree (the walk cost ~400 µs
    a step on a 137-module ResNet chain): it walks again after a hook handle was made anywhere,
    a submodule was set, or a watched hook dict changed size (a hook removed)."""
    from fxremat.passes import trace

    walks = []
    walk = trace.hooked_modules
    monkeypatch.setattr(trace, "hooked_modules", lambda model: walks.append(1) or walk(model))
    torch.manual_seed(0)
    plain, model = pair(Net())
    compiled = _compiled(model)
    x = torch.randn(*X)
    assert torch.equal(_step(plain, x), _step(compiled, x))  # (planning set submodules: one walk)
    walks.clear()
    for seed in range(1, 3):
        assert torch.equal(_step(plain, x, seed), _step(compiled, x, seed))
    assert walks == []
    double = lambda m, i, o: o * 2  # noqa: E731
    handles = [m.blocks[2].register_forward_hook(double) for m in (plain, compiled)]
    for seed in range(3, 6):
        assert torch.equal(_step(plain, x, seed), _step(compiled, x, seed))
    assert compiled._remat.hooks.names == frozenset({"blocks.2"})
    assert 1 <= len(walks) <= 3  # the step after the hook came, the retrace's own, the step after it
    walks.clear()
    for h in handles:
        h.remove()
    assert torch.equal(_step(plain, x, 6), _step(compiled, x, 6))
    assert walks and compiled._remat.hooks.names == frozenset()  # the removal was seen: traced again
    assert torch.equal(_step(plain, x, 7), _step(compiled, x, 7))  # (planning again set submodules)
    walks.clear()
    assert torch.equal(_step(plain, x, 8), _step(compiled, x, 8))
    assert walks == []
    assert_same_state(plain, compiled)


def test_a_submodule_set_with_a_hook_of_its_own_is_seen():
    """A submodule made and hooked before compiling, then set in place of another: no hook handle
    is made after compiling, but the submodule set is counted, and its hook runs as in eager."""
    torch.manual_seed(0)
    plain, model = pair(Net())
    calls = []
    spares = [nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU()) for _ in range(2)]
    spares[1].load_state_dict(spares[0].state_dict())
    for spare in spares:
        spare.register_forward_hook(lambda m, i, o: calls.append(1) or o * 2)
    compiled = _compiled(model)
    x = torch.randn(*X)
    assert torch.equal(_step(plain, x), _step(compiled, x))
    plain.blocks[1], model.blocks[1] = spares
    calls.clear()
    assert torch.equal(_step(plain, x, 1), _step(compiled, x, 1))
    assert len(calls) >= 2 and compiled._remat.hooks.names == frozenset({"blocks.1"})


def test_hook_fingerprint_names_what_named_modules_names():
    """The per-step fingerprint walks the module tree itself: it names each hooked submodule by
    its first path in ``named_modules()`` (a shared module once), skips torch's own hooks and
    the root's, and sees global hooks."""
    from fxremat.passes.trace import hooked_modules

    shared = nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old weight_norm: a hook defined in torch
        normed = torch.nn.utils.weight_norm(nn.Linear(2, 2))
    model = nn.Sequential(nn.Sequential(shared, nn.ReLU()), nn.ModuleDict({"a": shared, "b": nn.Linear(2, 2)}),
                          nn.Sequential(nn.Identity(), shared, normed), None)
    assert normed._forward_pre_hooks and hooked_modules(model) == frozenset()
    shared.register_forward_hook(lambda m, i, o: None)
    model[1]["b"].register_forward_pre_hook(lambda m, i: None)
    model[0].register_full_backward_hook(lambda m, gi, go: None)
    model.register_forward_hook(lambda m, i, o: None)  # the root: runs around the graph
    first_paths = {id(m): name for name, m in reversed(list(model.named_modules())) if name}
    expected = frozenset(first_paths[id(m)] for m in (shared, model[1]["b"], model[0]))
    assert hooked_modules(model) == expected == frozenset({"0.0", "1.b", "0"})
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        assert hooked_modules(model) == expected | {"<global>"}
    finally:
        handle.remove()



def test_an_eager_step_does_not_enter_dynamo():
    """Planning and the hook check run outside compiled graphs under torch.compile; in an eager
    step they are called directly: ``torch.compiler.disable``'s wrapper costs ~70 µs a call after
    a forward pass, 1-2% of a small net's step."""
    import os
    import sys

    torch.manual_seed(0)
    _, model = pair(Net())
    compiled = _compiled(model)
    x = torch.randn(*X)
    _step(compiled, x)  # planned
    entered, package = [], os.path.dirname(fxremat.__file__)

    def profiler(frame, event, arg):  # Dynamo entered from fxremat's code (torch's checkpoint enters it itself)
        if (event == "call" and frame.f_back is not None and frame.f_back.f_code.co_filename.startswith(package)
                and os.path.join("torch", "_dynamo") in frame.f_code.co_filename):
            entered.append(f"{frame.f_back.f_code.co_name} -> {frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(profiler)
    try:
        _step(compiled, x)
    finally:
        sys.setprofile(None)
    assert entered == [], sorted(set(entered))

def test_root_hooks_and_full_backward_hook():
    torch.manual_seed(0)
    plain, model = pair(Net())
    grads = {"plain": [], "compiled": []}
    for tag, m in (("plain", plain), ("compiled", model)):
        m.register_forward_hook(lambda mod, i, o: o + 1)
        m.blocks[3].register_full_backward_hook(
            lambda mod, gi, go, tag=tag: grads[tag].append(go[0].clone()))
    compiled = _compiled(model)
    x = torch.randn(*X)
    assert torch.equal(_step(plain, x), _step(compiled, x))
    assert_same_state(plain, compiled)
    assert len(grads["plain"]) == 1 and len(grads["compiled"]) >= 1
    assert torch.equal(grads["plain"][0], grads["compiled"][-1])


# ---------------------------------------------------------------- item 2: compiled in eval()


def test_compiled_in_eval_trains_within_budget_and_exact():
    torch.manual_seed(0)
    plain, model = pair(Net(c=16, n=6))
    model.eval()
    x = torch.randn(4, 3, 32, 32)
    compiled = fxremat.compile(model, 0.5, example_inputs=(x,), cost_model="flops")
    assert not compiled.training and not model.training  # mode left as the user set it
    compiled.train()
    with_grads(plain), with_grads(compiled)
    out_a, _ = fxremat.measure_peak(_step, plain, x)
    out_b, peak = fxremat.measure_peak(_step, compiled, x)
    assert torch.equal(out_a, out_b)
    assert_same_state(plain, compiled)
    assert peak <= compiled.plan.budget_bytes * 1.05


# ---------------------------------------------------------------- item 4: changing shapes


class Tiny(nn.Module):
    def __init__(self, d=32, n=3):
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d, 4, 64, dropout=0.1, batch_first=True)
                                    for _ in range(n))
        self.out = nn.Linear(d, 50)

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


# The tests of plans kept across shapes keep each layer one node: traced through (about 11 nodes a
# layer), replanning every shape took 1.7x the time, and the nodes change nothing they test.
_LAYERS = (nn.TransformerEncoderLayer,)


def _lm_step(model, ids, seed=0):
    torch.manual_seed(seed)
    out = model(ids)
    F.cross_entropy(out.flatten(0, 1), ids.flatten()).backward()
    return out.detach()


def test_cycling_shapes_reuse_the_plan_hold_the_budget_and_warn_once(monkeypatch):
    torch.manual_seed(0)
    plain, model = pair(Tiny())
    compiled = fxremat.compile(model, 0.7, cost_model="flops", max_plans=2, leaf_modules=_LAYERS)
    with_grads(plain), with_grads(compiled)
    calls = {"profile": 0}
    real_profile = fxremat.api.profile

    def counting(*a, **k):
        calls["profile"] += 1
        return real_profile(*a, **k)

    monkeypatch.setattr(fxremat.api, "profile", counting)
    lengths = [8, 12, 16, 20, 24]
    for length in lengths:  # warm-up: every length planned once
        ids = torch.randint(0, 50, (2, length))
        assert torch.equal(_lm_step(plain, ids), _lm_step(compiled, ids))
    warm = calls["profile"]
    assert warm == len(lengths)  # one measured/flops profile, then bytes only per new size
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rnd in range(2):
            for length in lengths:
                ids = torch.randint(0, 50, (2, length))
                out_a, _ = fxremat.measure_peak(_lm_step, plain, ids, seed=rnd)
                out_b, peak = fxremat.measure_peak(_lm_step, compiled, ids, seed=rnd)
                assert torch.equal(out_a, out_b)
                assert peak <= compiled.plan.budget_bytes * 1.05, (length, peak, compiled.plan.budget_bytes)
    assert calls["profile"] == warm  # seen shapes: no re-profile, no re-solve
    assert not [w for w in caught if "planning again" in str(w.message)]
    assert_same_state(plain, compiled)


def test_replanning_repeats_warns_once():
    torch.manual_seed(0)
    model = Tiny(n=2)
    compiled = fxremat.compile(model, "min", cost_model="flops", max_plans=1, leaf_modules=_LAYERS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # 1 plan x 8 shapes remembered: 12 distinct lengths, cycled twice, evict and plan again
        for _ in range(2):
            for length in range(4, 28, 2):
                _lm_step(compiled, torch.randint(0, 50, (1, length)))
    again = [w for w in caught if "planning again" in str(w.message)]
    assert len(again) == 1 and "max_plans" in str(again[0].message)
