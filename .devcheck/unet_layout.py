import copy, statistics, sys, time, torch
sys.path.insert(0, '.')
import fxremat
from benchmarks.nets import cpu_nets
from benchmarks.harness import caching_heap, timed_step, step
from benchmarks.compile_budget import _own_code, allocated_peak
torch.set_num_threads(2)
print(caching_heap())
net = sys.argv[1]
build, shape = [(b, s) for n, b, s, _ in cpu_nets(False) if n == net][0]
torch.manual_seed(0)
base = build("small")
x = torch.randn(*shape)
variants = {}
plain = torch.compile(_own_code(copy.deepcopy(base), "plain"))
step(plain, x); variants["inductor"] = plain
import torch._inductor.config as ic
ic.layout_optimization = False
plain2 = torch.compile(_own_code(copy.deepcopy(base), "plain_nolayout"))
step(plain2, x); variants["inductor-nolayout"] = plain2
budgets = [float(b) if b != "min" else b for b in sys.argv[2:]]
for b in budgets:
    t = time.time()
    m = fxremat.compile(copy.deepcopy(base), b, example_inputs=(x,), backend="inductor")
    step(m, x)
    p = m.plan
    print(f"budget {b}: {p.strategy} budget {p.budget_bytes/2**20:.1f} pred {p.predicted_peak_bytes/2**20:.1f} MiB overhead {p.predicted_overhead:.3f} rec {sum(s.recomputed for s in p.segments)} compile {time.time()-t:.0f}s notes {p.notes[-1][:220]}", flush=True)
    variants[f"fx{b}-nolayout"] = m
peaks = {k: allocated_peak(step, m, x) / 2**20 for k, m in variants.items()}
times = {k: [] for k in variants}
for r in range(9):
    for k, m in variants.items():
        times[k].append(timed_step(m, x))
base_t = statistics.median(times["inductor"])
for k in variants:
    print(f"{k}: peak {peaks[k]:.1f} MiB step/inductor {statistics.median(times[k])/base_t:.3f}")
