# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compiled DP kernels of fxremat: plain arrays in, plain arrays out.

Each function here has a pure-Python reference of the same name, signature and results
(:func:`fxremat.lowersets.enumerate_lower_sets`, :func:`fxremat.solvers.kusumoto.set_tables`,
:func:`fxremat.solvers.kusumoto.solve_dp`, :func:`fxremat.solvers.kusumoto.completion_bounds`,
:func:`fxremat.solvers.rotor.rotor_table`);
:mod:`fxremat._kernels` picks one. No graph logic
and no torch objects in here: bitsets arrive packed as rows of uint64 words (least significant
word first, ``words(n) = max(1, ceil(n / 64))`` per row), per-node and per-set numbers as int64.
Arithmetic is int64 throughout (byte counts exceed 2**31).

Kusumoto DP (:func:`solve_dp`): the sparse table is, per lower set, a *staircase* of its
undominated labels (sorted by key, strictly decreasing kept bytes m), maintained on insertion
instead of a dict that is filtered later. Dropping a label that another label of the same set
dominates (smaller key, no larger m) cannot change any undominated label, and equal keys keep
the reference's tie rule (best secondary value, first arrival), so the staircase of each set
equals the reference's front and back-pointers and answers are identical. The reference tries
every pair j < k; here the k for a j are found as an AND of per-node containment bitsets over
the sets ranked by S (or T), cut at the first rank that the budget (or time bound) excludes.
:func:`completion_bounds` runs the same search backwards with one number per set (the bytes
it needs to reach V); :func:`solve_dp` drops the labels it shows cannot reach V.

Lower sets (:func:`enumerate_lower_sets`): depth-first over the groups in topological order,
each lower set reached once, then sorted like the reference (by size, then value).
"""

from cpython cimport array
import array as _array
import math

from libc.float cimport DBL_MAX
from libc.stdint cimport INT64_MAX, INT64_MIN, int32_t, int64_t, uint8_t, uint64_t
from libc.stdlib cimport free, malloc, qsort, realloc
from libc.string cimport memcpy, memmove, memset

cdef extern from *:
    int __builtin_popcountll(unsigned long long) nogil
    int __builtin_ctzll(unsigned long long) nogil
    int __builtin_clzll(unsigned long long) nogil
    void __builtin_prefetch(const void*) nogil
    ctypedef long long int128 "__int128"

cdef array.array _WORDS = _array.array("Q")
cdef array.array _INT64 = _array.array("q")


cdef inline Py_ssize_t _width(Py_ssize_t n) noexcept nogil:
    return 1 if n <= 64 else (n + 63) // 64


# --------------------------------------------------------------------------- lower sets


cdef struct _Enum:
    const uint64_t* gpred
    const uint64_t* members
    Py_ssize_t groups, gw, w, cap, count, capacity
    uint64_t* gset
    uint64_t* nset
    uint64_t* out


cdef int _emit(_Enum* e) noexcept nogil:
    cdef uint64_t* grown
    if e.cap >= 0 and e.count >= e.cap:
        return 1
    if e.count == e.capacity:
        e.capacity = 2 * e.capacity + 256
        grown = <uint64_t*> realloc(e.out, e.capacity * e.w * sizeof(uint64_t))
        if grown == NULL:
            return -1
        e.out = grown
    memcpy(e.out + e.count * e.w, e.nset, e.w * sizeof(uint64_t))
    e.count += 1
    return 0


cdef int _enumerate(_Enum* e, Py_ssize_t g) noexcept nogil:
    """Every lower set that agrees with ``e.gset`` on groups < g: include g if it can be, then
    exclude it (groups are in topological order, so each set is reached exactly once)."""
    cdef Py_ssize_t i
    cdef const uint64_t* p
    cdef const uint64_t* mem
    cdef int rc, ready
    while True:
        while g < e.groups:
            p = e.gpred + g * e.gw
            ready = 1
            for i in range(e.gw):
                if p[i] & ~e.gset[i]:
                    ready = 0
                    break
            if ready:
                break
            g += 1
        if g == e.groups:
            return _emit(e)
        mem = e.members + g * e.w
        e.gset[g >> 6] |= (<uint64_t> 1) << (g & 63)
        for i in range(e.w):
            e.nset[i] ^= mem[i]
        rc = _enumerate(e, g + 1)
        e.gset[g >> 6] &= ~((<uint64_t> 1) << (g & 63))
        for i in range(e.w):
            e.nset[i] ^= mem[i]
        if rc:
            return rc
        g += 1


cdef const uint64_t* _sort_rows
cdef const int* _sort_pop
cdef Py_ssize_t _sort_w


cdef int _by_size(const void* a, const void* b) noexcept nogil:
    cdef Py_ssize_t i = (<const Py_ssize_t*> a)[0]
    cdef Py_ssize_t j = (<const Py_ssize_t*> b)[0]
    cdef Py_ssize_t x
    cdef uint64_t u, v
    if _sort_pop[i] != _sort_pop[j]:
        return -1 if _sort_pop[i] < _sort_pop[j] else 1
    x = _sort_w - 1
    while x >= 0:
        u = _sort_rows[i * _sort_w + x]
        v = _sort_rows[j * _sort_w + x]
        if u != v:
            return -1 if u < v else 1
        x -= 1
    return 0


cdef array.array _sorted_rows(const uint64_t* rows, Py_ssize_t count, Py_ssize_t w):
    """The rows sorted by popcount, then value (most significant word first)."""
    global _sort_rows, _sort_pop, _sort_w
    cdef Py_ssize_t i, x
    cdef int c
    cdef int* pop = <int*> malloc((count + 1) * sizeof(int))
    cdef Py_ssize_t* order = <Py_ssize_t*> malloc((count + 1) * sizeof(Py_ssize_t))
    cdef array.array out = array.clone(_WORDS, count * w, zero=False)
    cdef uint64_t* dst = <uint64_t*> out.data.as_ulonglongs
    if pop == NULL or order == NULL:
        free(pop)
        free(order)
        raise MemoryError()
    for i in range(count):
        c = 0
        for x in range(w):
            c += __builtin_popcountll(rows[i * w + x])
        pop[i] = c
        order[i] = i
    _sort_rows, _sort_pop, _sort_w = rows, pop, w
    qsort(order, count, sizeof(Py_ssize_t), _by_size)
    for i in range(count):
        memcpy(dst + i * w, rows + order[i] * w, w * sizeof(uint64_t))
    free(pop)
    free(order)
    return out


def enumerate_lower_sets(const uint64_t[::1] group_preds, const uint64_t[::1] members,
                         Py_ssize_t n_groups, Py_ssize_t n_nodes, Py_ssize_t cap):
    """Lower sets of the quotient DAG, as packed node bitsets sorted by size then value, or
    ``None`` when there are more than ``cap`` (``cap < 0``: no cap). Depth-first: each lower
    set is reached once, by deciding the groups in topological order."""
    cdef _Enum e
    cdef int rc
    cdef array.array result
    e.groups, e.gw, e.w, e.cap = n_groups, _width(n_groups), _width(n_nodes), cap
    if group_preds.shape[0] != n_groups * e.gw or members.shape[0] != n_groups * e.w:
        raise ValueError("fxremat._dp.enumerate_lower_sets: array sizes do not match the counts")
    e.gpred = &group_preds[0] if n_groups else NULL
    e.members = &members[0] if n_groups else NULL
    e.count, e.capacity, e.out = 0, 0, NULL
    e.gset = <uint64_t*> malloc(e.gw * sizeof(uint64_t))
    e.nset = <uint64_t*> malloc(e.w * sizeof(uint64_t))
    try:
        if e.gset == NULL or e.nset == NULL:
            raise MemoryError()
        memset(e.gset, 0, e.gw * sizeof(uint64_t))
        memset(e.nset, 0, e.w * sizeof(uint64_t))
        with nogil:
            rc = _enumerate(&e, 0)
        if rc < 0:
            raise MemoryError()
        if rc > 0:
            return None
        return _sorted_rows(e.out, e.count, e.w)
    finally:
        free(e.gset)
        free(e.nset)
        free(e.out)


# --------------------------------------------------------------------------- per-set tables


def set_tables(const uint64_t[::1] sets, const uint64_t[::1] succ, const uint8_t[::1] is_output,
               const int64_t[::1] root, const int64_t[::1] grad, const int64_t[::1] additive,
               const int64_t[::1] time):
    """Per packed lower set: (storage owners of ∂(L), maximal nodes of L, G(∂(L)), T(L),
    Σ_L additive)."""
    cdef Py_ssize_t n = time.shape[0]
    cdef Py_ssize_t w = _width(n)
    cdef Py_ssize_t count = sets.shape[0] // w
    cdef Py_ssize_t s, x, y, v, r
    cdef uint64_t word
    cdef const uint64_t* low
    cdef int boundary, top
    cdef int64_t gb, tt, ss
    if (succ.shape[0] != n * w or is_output.shape[0] != n or root.shape[0] != n
            or grad.shape[0] != n or additive.shape[0] != n or sets.shape[0] != count * w):
        raise ValueError("fxremat._dp.set_tables: array sizes do not match the node count")
    for v in range(n):
        if root[v] < 0 or root[v] >= n:
            raise ValueError(f"fxremat._dp.set_tables: root[{v}] = {root[v]} is not a node")
    cdef array.array keep = array.clone(_WORDS, count * w, zero=True)
    cdef array.array tops = array.clone(_WORDS, count * w, zero=True)
    cdef uint64_t* topp = <uint64_t*> tops.data.as_ulonglongs
    cdef array.array grad_boundary = array.clone(_INT64, count, zero=False)
    cdef array.array prefix_time = array.clone(_INT64, count, zero=False)
    cdef array.array prefix_saved = array.clone(_INT64, count, zero=False)
    cdef uint64_t* kp = <uint64_t*> keep.data.as_ulonglongs
    cdef int64_t* gp = <int64_t*> grad_boundary.data.as_longlongs
    cdef int64_t* tp = <int64_t*> prefix_time.data.as_longlongs
    cdef int64_t* sp = <int64_t*> prefix_saved.data.as_longlongs
    with nogil:
        for s in range(count):
            low = &sets[s * w]
            gb, tt, ss = 0, 0, 0
            for x in range(w):
                word = low[x]
                while word:
                    v = x * 64 + __builtin_ctzll(word)
                    word &= word - 1
                    tt += time[v]
                    ss += additive[v]
                    boundary, top = is_output[v] != 0, 1
                    for y in range(w):
                        if succ[v * w + y] & ~low[y]:
                            boundary = 1
                        if succ[v * w + y] & low[y]:
                            top = 0
                    if top:
                        topp[s * w + (v >> 6)] |= (<uint64_t> 1) << (v & 63)
                    if boundary:
                        gb += grad[v]
                        r = root[v]
                        kp[s * w + (r >> 6)] |= (<uint64_t> 1) << (r & 63)
            gp[s], tp[s], sp[s] = gb, tt, ss
    return keep, tops, grad_boundary, prefix_time, prefix_saved


# --------------------------------------------------------------------------- Kusumoto DP


cdef struct Label:
    int64_t t
    int64_t m
    int64_t peak
    int32_t back_set
    int32_t back_index


cdef struct Stair:
    Label* lab
    Py_ssize_t size
    Py_ssize_t capacity


cdef int _make_room(Stair* st) noexcept nogil:
    cdef Label* grown
    if st.size < st.capacity:
        return 0
    st.capacity = 2 * st.capacity + 4
    grown = <Label*> realloc(st.lab, st.capacity * sizeof(Label))
    if grown == NULL:
        return -1
    st.lab = grown
    return 0


cdef int _replace_from(Stair* st, Py_ssize_t p, Label* c) noexcept nogil:
    """Put ``c`` at position p, dropping the labels from p on that it dominates (m >= c.m)."""
    cdef Py_ssize_t q = p
    while q < st.size and st.lab[q].m >= c.m:
        q += 1
    if q == p:
        if _make_room(st) < 0:
            return -1
        memmove(st.lab + p + 1, st.lab + p, (st.size - p) * sizeof(Label))
        st.size += 1
    elif q > p + 1:
        memmove(st.lab + p + 1, st.lab + q, (st.size - q) * sizeof(Label))
        st.size -= q - p - 1
    st.lab[p] = c[0]
    return 0


cdef int _drop_after(Stair* st, Py_ssize_t p) noexcept nogil:
    """Drop the labels after p that label p dominates."""
    cdef Py_ssize_t q = p + 1
    while q < st.size and st.lab[q].m >= st.lab[p].m:
        q += 1
    if q > p + 1:
        memmove(st.lab + p + 1, st.lab + q, (st.size - q) * sizeof(Label))
        st.size -= q - p - 1
    return 0


cdef int _insert_time(Stair* st, Label* c) noexcept nogil:
    """Key t; same key: smaller (m, peak) wins, first arrival on ties."""
    cdef Py_ssize_t lo = 0, hi = st.size, mid
    cdef Label* e
    while lo < hi:
        mid = (lo + hi) >> 1
        if st.lab[mid].t < c.t:
            lo = mid + 1
        else:
            hi = mid
    if lo < st.size and st.lab[lo].t == c.t:
        e = &st.lab[lo]
        if c.m < e.m or (c.m == e.m and c.peak < e.peak):
            e[0] = c[0]
            return _drop_after(st, lo)
        return 0
    if lo > 0 and st.lab[lo - 1].m <= c.m:
        return 0
    return _replace_from(st, lo, c)


cdef int _insert_memory(Stair* st, Label* c) noexcept nogil:
    """Key (peak, m); same key: smaller t wins, first arrival on ties."""
    cdef Py_ssize_t lo = 0, hi = st.size, mid
    cdef Label* e
    while lo < hi:
        mid = (lo + hi) >> 1
        e = &st.lab[mid]
        if e.peak < c.peak or (e.peak == c.peak and e.m < c.m):
            lo = mid + 1
        else:
            hi = mid
    if lo < st.size and st.lab[lo].peak == c.peak and st.lab[lo].m == c.m:
        e = &st.lab[lo]
        if c.t < e.t:
            e.t, e.back_set, e.back_index = c.t, c.back_set, c.back_index
        return 0
    if lo > 0 and st.lab[lo - 1].m <= c.m:
        return 0
    return _replace_from(st, lo, c)


cdef inline bint _better_final(Label* c, Label* best, bint time_objective) noexcept nogil:
    """The reference's pick among the labels of V: least (t, m, peak) or (peak, t, m)."""
    if time_objective:
        if c.t != best.t:
            return c.t < best.t
        if c.m != best.m:
            return c.m < best.m
        return c.peak < best.peak
    if c.peak != best.peak:
        return c.peak < best.peak
    if c.t != best.t:
        return c.t < best.t
    return c.m < best.m


cdef int64_t* _chunk_tables(const int64_t[::1] weights, Py_ssize_t w, bint summed):
    """For every 8-bit chunk c and byte x != 0: the sum (``summed``) or the max of
    weights[8c + b] over the bits b of x; 0 for x = 0."""
    cdef Py_ssize_t n = weights.shape[0], c, x, b
    cdef int64_t* tab = <int64_t*> malloc(w * 8 * 256 * sizeof(int64_t))
    cdef int64_t value, rest
    if tab == NULL:
        raise MemoryError()
    for c in range(w * 8):
        tab[c * 256] = 0
        for x in range(1, 256):
            b = __builtin_ctzll(x)
            value = weights[8 * c + b] if 8 * c + b < n else 0
            if x & (x - 1):
                rest = tab[c * 256 + (x & (x - 1))]
                value = value + rest if summed else max(value, rest)
            tab[c * 256 + x] = value
    return tab


cdef inline int64_t _word_sum(const int64_t* tab, Py_ssize_t x, uint64_t word) noexcept nogil:
    """Sum of a per-node weight over the bits of word x of a bitset (summed _chunk_tables)."""
    cdef int64_t total = 0
    cdef Py_ssize_t b
    cdef uint64_t byte
    for b in range(8):
        byte = (word >> (8 * b)) & 255
        if byte:
            total += tab[(x * 8 + b) * 256 + byte]
    return total


cdef int64_t _clamp(object budget):
    """A bound as int64 (``mem <= budget`` is unchanged for integer mem); None: no bound."""
    if budget is None or budget >= INT64_MAX:
        return INT64_MAX
    if budget <= INT64_MIN:
        return INT64_MIN
    return math.floor(budget)


cdef struct _Order:
    Py_ssize_t* index        # index[r]: the set of rank r
    int64_t* value           # value[r]: its S (or T), ascending
    uint64_t* contains       # contains[v * cw + r // 64] bit r: node v is in the set of rank r


cdef struct _Key:
    int64_t value
    Py_ssize_t index


cdef int _by_value(const void* a, const void* b) noexcept nogil:
    cdef const _Key* x = <const _Key*> a
    cdef const _Key* y = <const _Key*> b
    if x.value != y.value:
        return -1 if x.value < y.value else 1
    return -1 if x.index < y.index else (1 if x.index > y.index else 0)


cdef int _rank(_Order* order, const int64_t* values, const uint64_t* sets, Py_ssize_t n,
               Py_ssize_t count, Py_ssize_t w, Py_ssize_t cw) noexcept nogil:
    """Rank the sets by ``values`` (ties by index) and build the containment bitsets."""
    cdef _Key* keys = <_Key*> malloc(count * sizeof(_Key))
    cdef Py_ssize_t r, k, x, v
    cdef uint64_t word
    order.index = <Py_ssize_t*> malloc(count * sizeof(Py_ssize_t))
    order.value = <int64_t*> malloc(count * sizeof(int64_t))
    order.contains = <uint64_t*> malloc((n * cw + 1) * sizeof(uint64_t))
    if keys == NULL or order.index == NULL or order.value == NULL or order.contains == NULL:
        free(keys)
        return -1
    for k in range(count):
        keys[k].value, keys[k].index = values[k], k
    qsort(keys, count, sizeof(_Key), _by_value)
    memset(order.contains, 0, (n * cw + 1) * sizeof(uint64_t))
    for r in range(count):
        k = keys[r].index
        order.index[r], order.value[r] = k, keys[r].value
        for x in range(w):
            word = sets[k * w + x]
            while word:
                v = x * 64 + __builtin_ctzll(word)
                word &= word - 1
                order.contains[v * cw + (r >> 6)] |= (<uint64_t> 1) << (r & 63)
    free(keys)
    return 0


cdef void _free_order(_Order* order) noexcept nogil:
    free(order.index)
    free(order.value)
    free(order.contains)


cdef inline Py_ssize_t _count_at_most(const _Order* order, Py_ssize_t count, int64_t threshold) noexcept nogil:
    """How many ranks have value <= threshold (they come first)."""
    cdef Py_ssize_t lo = 0, hi = count, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if order.value[mid] <= threshold:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef struct _Problem:
    const uint64_t* sets
    const uint64_t* keep
    const int64_t* grad_boundary
    const int64_t* prefix_time
    const int64_t* prefix_saved
    const int64_t* out_bytes
    const int64_t* tmax      # see _chunk_tables (max)
    const int64_t* time      # forward time per node
    const uint8_t* stop      # stop kind per node (CostGraph.stop_kind)
    int64_t* tsum            # chunk sums of time, of hooks (see _chunk_tables)
    int64_t* hsum
    uint64_t* stops          # bitset: nodes that save a tensor (stop kind > 0)
    bint whole               # every stop kind is 2: a step's time is T_k - T_j (prefix_time)
    bint hooks               # some hook time is not 0
    _Order by_saved          # the sets ranked by S (prefix_saved)
    _Order by_time           # the sets ranked by T (prefix_time)
    uint64_t* candidates     # scratch: bitset of ranks
    int64_t loss_bytes
    int64_t limit
    int64_t time_limit
    Py_ssize_t count
    Py_ssize_t n_nodes
    Py_ssize_t w             # words per node bitset
    Py_ssize_t cw            # words per set bitset
    bint time_objective
    bint nonnegative         # out_bytes, transient >= 0: a step costs at least S_k - S_j + G(∂(L_j))
    const int64_t* reach     # per set, the least bytes a label there needs to reach V (or NULL)
    Stair* stairs
    Label best
    bint found


cdef _setup(_Problem* pb, const uint64_t[::1] sets, const uint64_t[::1] keep, const uint64_t[::1] tops,
            const int64_t[::1] grad_boundary, const int64_t[::1] prefix_time,
            const int64_t[::1] prefix_saved, const int64_t[::1] out_bytes,
            const int64_t[::1] transient, const int64_t[::1] time, const int64_t[::1] hook,
            const uint8_t[::1] stop, int64_t loss_bytes, budget, str name):
    """Check the arrays and fill ``pb`` (all but the objective's fields); the caller frees it
    with :func:`_release` whatever happens."""
    cdef Py_ssize_t n = out_bytes.shape[0]
    cdef Py_ssize_t w = _width(n)
    cdef Py_ssize_t count = grad_boundary.shape[0]
    cdef Py_ssize_t j
    memset(pb, 0, sizeof(_Problem))
    if (sets.shape[0] != count * w or keep.shape[0] != count * w or tops.shape[0] != count * w
            or prefix_time.shape[0] != count or prefix_saved.shape[0] != count
            or transient.shape[0] != n or time.shape[0] != n or hook.shape[0] != n or stop.shape[0] != n
            or count == 0):
        raise ValueError(f"fxremat._dp.{name}: array sizes do not match the set and node counts")
    pb.sets, pb.keep, pb.grad_boundary = &sets[0], &keep[0], &grad_boundary[0]
    pb.prefix_time, pb.prefix_saved = &prefix_time[0], &prefix_saved[0]
    pb.out_bytes = &out_bytes[0] if n else NULL
    pb.loss_bytes, pb.count, pb.w, pb.cw, pb.n_nodes = loss_bytes, count, w, (count + 63) // 64, n
    pb.limit, pb.time_limit = _clamp(budget), INT64_MAX
    pb.nonnegative = all(out_bytes[j] >= 0 for j in range(n)) and all(transient[j] >= 0 for j in range(n))
    pb.tmax = _chunk_tables(transient, w, False)
    pb.tsum, pb.hsum = _chunk_tables(time, w, True), _chunk_tables(hook, w, True)
    pb.time = &time[0] if n else NULL
    pb.stop = &stop[0] if n else NULL
    pb.stops = <uint64_t*> malloc(w * sizeof(uint64_t))
    if pb.stops == NULL:
        raise MemoryError()
    memset(pb.stops, 0, w * sizeof(uint64_t))
    pb.whole, pb.hooks = True, False
    for j in range(n):
        if stop[j]:
            pb.stops[j >> 6] |= (<uint64_t> 1) << (j & 63)
        pb.whole = pb.whole and stop[j] == 2
        pb.hooks = pb.hooks or hook[j] != 0
    for j in range(count * w):
        if tops[j] & ~sets[j]:
            raise ValueError(f"fxremat._dp.{name}: tops[{j // w}] is not a subset of sets[{j // w}]")
    if _rank(&pb.by_saved, &prefix_saved[0], &sets[0], n, count, w, pb.cw) < 0:
        raise MemoryError()
    pb.candidates = <uint64_t*> malloc(pb.cw * sizeof(uint64_t))
    if pb.candidates == NULL:
        raise MemoryError()


cdef void _release(_Problem* pb) noexcept:
    cdef Py_ssize_t j
    if pb.stairs != NULL:
        for j in range(pb.count):
            free(pb.stairs[j].lab)
    free(pb.stairs)
    free(<void*> pb.tmax)
    free(pb.tsum)
    free(pb.hsum)
    free(pb.stops)
    _free_order(&pb.by_saved)
    _free_order(&pb.by_time)
    free(pb.candidates)


def solve_dp(const uint64_t[::1] sets, const uint64_t[::1] keep, const uint64_t[::1] tops,
             const int64_t[::1] grad_boundary, const int64_t[::1] prefix_time,
             const int64_t[::1] prefix_saved, const int64_t[::1] out_bytes,
             const int64_t[::1] transient, const int64_t[::1] time, const int64_t[::1] hook,
             const uint8_t[::1] stop, int64_t loss_bytes, budget, str objective,
             time_limit=None, reach=None):
    """Algorithm 1 over a packed family; ``(chain, t, peak)`` or ``None`` (see the reference,
    :func:`fxremat.solvers.kusumoto.solve_dp`)."""
    cdef int rc = 0
    cdef _Problem pb
    cdef const int64_t[::1] needs
    if objective not in ("time", "memory"):
        raise ValueError(f"fxremat._dp.solve_dp: objective must be 'time' or 'memory', got {objective!r}")
    try:
        _setup(&pb, sets, keep, tops, grad_boundary, prefix_time, prefix_saved, out_bytes, transient, time,
               hook, stop, loss_bytes, budget, "solve_dp")
        if reach is not None:
            needs = reach
            if needs.shape[0] != pb.count:
                raise ValueError(f"fxremat._dp.solve_dp: reach has {needs.shape[0]} entries for {pb.count} sets")
            pb.reach = &needs[0]
        if pb.count == 1:
            return (), 0, 0
        pb.time_limit = _clamp(time_limit)
        pb.time_objective = objective == "time"
        if pb.time_objective and pb.time_limit != INT64_MAX:
            if _rank(&pb.by_time, &prefix_time[0], &sets[0], pb.n_nodes, pb.count, pb.w, pb.cw) < 0:
                raise MemoryError()
        pb.stairs = <Stair*> malloc(pb.count * sizeof(Stair))
        if pb.stairs == NULL:
            raise MemoryError()
        memset(pb.stairs, 0, pb.count * sizeof(Stair))
        pb.stairs[0].lab = <Label*> malloc(sizeof(Label))
        if pb.stairs[0].lab == NULL:
            raise MemoryError()
        pb.stairs[0].capacity = pb.stairs[0].size = 1
        pb.stairs[0].lab[0] = Label(0, 0, 0, -1, -1)
        with nogil:
            rc = _sweep(&pb, &tops[0])
        if rc < 0:
            raise MemoryError()
        if not pb.found:
            return None
        return _chain(pb.stairs, &pb.best, pb.count), pb.best.t, pb.best.peak
    finally:
        _release(&pb)


def completion_bounds(const uint64_t[::1] sets, const uint64_t[::1] keep, const uint64_t[::1] tops,
                      const int64_t[::1] grad_boundary, const int64_t[::1] prefix_time,
                      const int64_t[::1] prefix_saved, const int64_t[::1] out_bytes,
                      const int64_t[::1] transient, const int64_t[::1] time, const int64_t[::1] hook,
                      const uint8_t[::1] stop, int64_t loss_bytes, budget):
    """Per set, the least bytes a label there needs to reach V within ``budget`` (see the
    reference, :func:`fxremat.solvers.kusumoto.completion_bounds`)."""
    cdef _Problem pb
    cdef array.array needs
    try:
        _setup(&pb, sets, keep, tops, grad_boundary, prefix_time, prefix_saved, out_bytes, transient, time,
               hook, stop, loss_bytes, budget, "completion_bounds")
        needs = array.clone(_INT64, pb.count, zero=False)
        with nogil:
            _bounds(&pb, &tops[0], <int64_t*> needs.data.as_longlongs)
        return needs
    finally:
        _release(&pb)


cdef tuple _chain(Stair* stairs, Label* best, Py_ssize_t count):
    chain = [count - 1]
    cdef Py_ssize_t j = best.back_set, i = best.back_index
    cdef Label* lab
    while j != 0:
        chain.append(j)
        lab = &stairs[j].lab[i]
        j, i = lab.back_set, lab.back_index
    chain.reverse()
    return tuple(chain)


cdef Py_ssize_t _fill(_Problem* pb, const uint64_t* tops, Py_ssize_t j, _Order* order,
                      Py_ssize_t span) noexcept nogil:
    """Set ``pb.candidates`` to the ranks < span of ``order`` whose set holds every node of
    tops[j]; returns the words used."""
    cdef Py_ssize_t x, y, v, words_used = (span + 63) >> 6
    cdef uint64_t word
    cdef uint64_t* cand = pb.candidates
    cdef const uint64_t* row
    for x in range(words_used):
        cand[x] = ~(<uint64_t> 0)
    if span & 63:
        cand[words_used - 1] = ((<uint64_t> 1) << (span & 63)) - 1
    for x in range(pb.w):
        word = tops[j * pb.w + x]
        while word:
            v = x * 64 + __builtin_ctzll(word)
            word &= word - 1
            row = order.contains + v * pb.cw
            for y in range(words_used):
                cand[y] &= row[y]
    return words_used


cdef inline bint _hopeless(_Problem* pb, Py_ssize_t k, int64_t m) noexcept nogil:
    """A label of k with kept bytes m cannot reach V within the budget (``pb.reach``)."""
    return pb.reach != NULL and (pb.reach[k] == INT64_MAX or <int128> m + pb.reach[k] > pb.limit)


cdef inline bint _step_cost(_Problem* pb, Py_ssize_t j, Py_ssize_t k, int64_t* kept_out,
                            int64_t* step_out) noexcept nogil:
    """If L_j ⊆ L_k: the bytes the step L_j -> L_k keeps and the step's memory above m
    (the loss's buffers included when L_k = V); False otherwise."""
    cdef Py_ssize_t x, b, w = pb.w
    cdef const uint64_t* low = pb.sets + j * w
    cdef const uint64_t* high = pb.sets + k * w
    cdef uint64_t seg, kw, byte
    cdef int64_t kept = 0, trans = 0, tb
    cdef bint seen = False
    for x in range(w):
        if low[x] & ~high[x]:
            return False
    for x in range(w):
        seg = high[x] & ~low[x]
        if seg == 0:
            continue
        kw = pb.keep[k * w + x] & seg
        while kw:
            kept += pb.out_bytes[x * 64 + __builtin_ctzll(kw)]
            kw &= kw - 1
        for b in range(8):
            byte = (seg >> (8 * b)) & 255
            if byte:
                tb = pb.tmax[(x * 8 + b) * 256 + byte]
                if not seen or tb > trans:
                    trans, seen = tb, True
    kept_out[0] = kept
    step_out[0] = kept + pb.prefix_saved[k] - pb.prefix_saved[j] + pb.grad_boundary[j] + trans
    if k == pb.count - 1:
        step_out[0] += pb.loss_bytes
    return True


cdef Py_ssize_t _window(_Problem* pb, Py_ssize_t j, int64_t m_least, int64_t* saved_max) noexcept nogil:
    """How many ranks of ``pb.by_saved`` a step from j with kept bytes m_least may reach."""
    saved_max[0] = INT64_MAX
    if pb.nonnegative and pb.limit != INT64_MAX:
        saved_max[0] = _bound_saved(pb, j, m_least)
        return _count_at_most(&pb.by_saved, pb.count, saved_max[0])
    return pb.count


cdef void _bounds(_Problem* pb, const uint64_t* tops, int64_t* needs) noexcept nogil:
    """The reference's pass (:func:`fxremat.solvers.kusumoto.completion_bounds`), j descending.
    The k for a j are found as in :func:`_sweep` (with m = 0); they come in ascending S_k, and a
    step costs at least S_k - S_j + G(∂(L_j)), so the search stops once that reaches the best
    value so far (when sizes are non-negative)."""
    cdef Py_ssize_t j, k, x, words_used, final = pb.count - 1
    cdef int64_t saved_max, kept, step, best, value
    cdef uint64_t word
    needs[final] = 0
    j = final - 1
    while j >= 0:
        best = INT64_MAX
        if _step_cost(pb, j, final, &kept, &step) and step <= pb.limit:
            best = max(step, kept)
        words_used = _fill(pb, tops, j, &pb.by_saved, _window(pb, j, 0, &saved_max))
        x = 0
        while x < words_used:
            word = pb.candidates[x]
            x += 1
            while word:
                k = pb.by_saved.index[(x - 1) * 64 + __builtin_ctzll(word)]
                word &= word - 1
                if (pb.nonnegative and best != INT64_MAX
                        and <int128> pb.prefix_saved[k] - pb.prefix_saved[j] + pb.grad_boundary[j] >= best):
                    x, word = words_used, 0
                    break
                if (k > j and k != final and needs[k] != INT64_MAX and _step_cost(pb, j, k, &kept, &step)
                        and step <= pb.limit):
                    value = max(step, _saturate(<int128> kept + needs[k]))
                    if value < best:
                        best = value
        needs[j] = best if best <= pb.limit else INT64_MAX
        j -= 1


cdef int _sweep(_Problem* pb, const uint64_t* tops) noexcept nogil:
    """Relax every transition L_j ⊊ L_k of the family, j ascending (the reference's order).

    With a memory bound, only the k with S_k <= limit - m_least - G(∂(L_j)) + S_j can take a
    label of j (a step costs at least S_k - S_j + G(∂(L_j)) when sizes are non-negative); with
    a time bound, only those with T_k <= time_limit - t_least + T_j, and V (its step is free),
    where T is ``prefix_time``, the prefix sums of a floor of every segment's time
    (:func:`fxremat.solvers.kusumoto.time_floor`), so a step costs at least T_k - T_j.
    Ranking the sets by S (or T), these are the first ranks; among them, the candidates are the
    sets that contain every node of ``tops[j]``, an AND of containment bitsets (for lower sets
    and tops = maximal nodes, exactly the supersets; each is still checked). For a fixed j the
    order of the k does not matter: each k receives j's labels in one go, and V, last, after
    every smaller j. With ``pb.reach``, a k whose needs exceed the budget even from j's least m
    takes none of them.
    """
    cdef Py_ssize_t j, k, r, x, span, words_used, final = pb.count - 1
    cdef Stair* st
    cdef int64_t saved_max, time_max
    cdef uint64_t word
    cdef uint64_t* cand = pb.candidates
    cdef _Order* order
    for j in range(final):
        st = &pb.stairs[j]
        if st.size == 0:
            continue
        time_max, order = INT64_MAX, &pb.by_saved
        span = _window(pb, j, st.lab[st.size - 1].m, &saved_max)
        if pb.time_objective and pb.time_limit != INT64_MAX:
            time_max = _bound_time(pb, j, st.lab[0].t)
            r = _count_at_most(&pb.by_time, pb.count, time_max)
            if r < span:
                order, span = &pb.by_time, r
        words_used = _fill(pb, tops, j, order, span)
        for x in range(words_used):
            word = cand[x]
            while word:
                k = order.index[x * 64 + __builtin_ctzll(word)]
                word &= word - 1
                if (k > j and k != final and pb.prefix_saved[k] <= saved_max
                        and pb.prefix_time[k] <= time_max and not _hopeless(pb, k, st.lab[st.size - 1].m)
                        and _relax_pair(pb, j, k) < 0):
                    return -1
        if _relax_pair(pb, j, final) < 0:
            return -1
    return 0


cdef inline int64_t _saturate(int128 value) noexcept nogil:
    if value > INT64_MAX:
        return INT64_MAX
    if value < INT64_MIN:
        return INT64_MIN
    return <int64_t> value


cdef inline int64_t _bound_saved(_Problem* pb, Py_ssize_t j, int64_t m_least) noexcept nogil:
    """Largest S_k a step from j may reach within the memory bound."""
    return _saturate(<int128> pb.limit - m_least - pb.grad_boundary[j] + pb.prefix_saved[j])


cdef inline int64_t _bound_time(_Problem* pb, Py_ssize_t j, int64_t t_least) noexcept nogil:
    """Largest T_k a step from j may reach within the time bound."""
    return _saturate(<int128> pb.time_limit - t_least + pb.prefix_time[j])


cdef inline Py_ssize_t _first_over(Stair* st, int64_t t) noexcept nogil:
    """Index of the first label with time > t (labels sorted by time)."""
    cdef Py_ssize_t lo = 0, hi = st.size, mid
    while lo < hi:
        mid = (lo + hi) >> 1
        if st.lab[mid].t <= t:
            lo = mid + 1
        else:
            hi = mid
    return lo


cdef int64_t _segment_time(_Problem* pb, const uint64_t* low, const uint64_t* high) noexcept nogil:
    """T of the segment high \\ low (the reference's ``step_time``): the hooks of all its nodes,
    the forwards before its last node that saves a tensor, and that node's own if it saves after
    running."""
    cdef Py_ssize_t x, xs = -1, s
    cdef uint64_t seg, last = 0
    cdef int64_t total = 0
    for x in range(pb.w):
        seg = high[x] & ~low[x]
        if seg:
            if pb.hooks:
                total += _word_sum(pb.hsum, x, seg)
            if seg & pb.stops[x]:
                xs, last = x, seg & pb.stops[x]
    if xs < 0:
        return total
    s = xs * 64 + 63 - __builtin_clzll(last)
    for x in range(xs):
        total += _word_sum(pb.tsum, x, high[x] & ~low[x])
    total += _word_sum(pb.tsum, xs, (high[xs] & ~low[xs]) & (((<uint64_t> 1) << (s & 63)) - 1))
    if pb.stop[s] == 2:
        total += pb.time[s]
    return total


cdef int _relax_pair(_Problem* pb, Py_ssize_t j, Py_ssize_t k) noexcept nogil:
    """Extend j's labels by the step L_j -> L_k, if L_j ⊊ L_k."""
    cdef Py_ssize_t i, hi
    cdef const uint64_t* low = pb.sets + j * pb.w
    cdef const uint64_t* high = pb.sets + k * pb.w
    cdef int64_t kept, step, dt, mem
    cdef bint final = k == pb.count - 1
    cdef Stair* st = &pb.stairs[j]
    cdef Label c
    if not _step_cost(pb, j, k, &kept, &step):
        return 0
    if final:
        dt = 0
    if st.lab[st.size - 1].m + step > pb.limit or _hopeless(pb, k, st.lab[st.size - 1].m + kept):
        return 0
    if final:
        pass
    elif pb.whole:  # prefix_time holds every node's whole cost (kusumoto.time_floor)
        dt = pb.prefix_time[k] - pb.prefix_time[j]
    else:
        dt = _segment_time(pb, low, high)
    # labels with t + dt <= time_limit are a prefix (t ascending in the time objective)
    hi = st.size
    if pb.time_objective and pb.time_limit != INT64_MAX:
        hi = _first_over(st, pb.time_limit - dt)
    i = hi - 1
    while i >= 0:
        mem = st.lab[i].m + step
        if mem > pb.limit or _hopeless(pb, k, st.lab[i].m + kept):  # both grow with m: i descending
            break
        c.t = st.lab[i].t + dt
        c.m = st.lab[i].m + kept
        c.peak = mem if mem > st.lab[i].peak else st.lab[i].peak
        c.back_set = <int32_t> j
        c.back_index = <int32_t> i
        if c.t <= pb.time_limit:
            if final:
                if not pb.found or _better_final(&c, &pb.best, pb.time_objective):
                    pb.best, pb.found = c, True
            elif pb.time_objective:
                if _insert_time(&pb.stairs[k], &c) < 0:
                    return -1
            elif _insert_memory(&pb.stairs[k], &c) < 0:
                return -1
        i -= 1
    return 0


# --------------------------------------------------------------------------- rotor (heterogeneous chains)


cdef double _INF = float("inf")

cdef enum:
    _SLOT_BLOCK = 16             # F_ck: m in blocks of this many slots, each skipped if it cannot win
    _PREFETCH = 128              # F_ck: slots of the next split's rows to start loading
    _STAGE_BLOCK = 8             # rows computed for this many start stages s at a time (cache reuse)



cdef struct _RowInfo:
    Py_ssize_t first             # least m with a finite cost (width if none)
    double least                 # cost at m = slots, the row's minimum


cdef struct _Chain:
    Py_ssize_t n, width          # stages L; slots + 1 entries per row
    const double* uf
    const double* ub
    const int64_t* wa            # L + 1 entries
    const int64_t* wabar
    const int64_t* of
    const int64_t* ob
    double* cost                 # the flat tables: row (s, t) at _rotor_row(L, s, t) * width
    int* choice
    _RowInfo* info               # per row: where it turns finite and its least value


cdef inline Py_ssize_t _rotor_row(Py_ssize_t n, Py_ssize_t s, Py_ssize_t t) noexcept nogil:
    return (s - 1) * (n + 1) - (s - 1) * s // 2 + (t - s)


cdef inline Py_ssize_t _rotor_first_at_most(const double* row, Py_ssize_t lo, Py_ssize_t hi,
                                            double bound) noexcept nogil:
    """Least m in [lo, hi) with row[m] <= bound (hi if none); row is nonincreasing in m."""
    cdef Py_ssize_t mid
    while lo < hi:
        mid = lo + (hi - lo) // 2
        if row[mid] <= bound:
            hi = mid
        else:
            lo = mid + 1
    return lo


cdef void _rotor_leaf(_Chain* c, Py_ssize_t s) noexcept nogil:
    cdef Py_ssize_t i = s - 1, m
    cdef double* cost = c.cost + _rotor_row(c.n, s, s) * c.width
    cdef int* choice = c.choice + _rotor_row(c.n, s, s) * c.width
    cdef int64_t peak = max(c.wa[s] + c.wabar[i] + c.of[i], c.wa[s] + c.wabar[i] + c.wa[s - 1] + c.ob[i])
    for m in range(peak, c.width):
        cost[m] = c.uf[i] + c.ub[i]
        choice[m] = 0


cdef void _rotor_fall(_Chain* c, Py_ssize_t s, Py_ssize_t t) noexcept nogil:
    cdef Py_ssize_t i = s - 1, m, below = c.wabar[s - 1]
    cdef double* cost = c.cost + _rotor_row(c.n, s, t) * c.width
    cdef int* choice = c.choice + _rotor_row(c.n, s, t) * c.width
    cdef Py_ssize_t r = _rotor_row(c.n, s + 1, t)
    cdef const double* rest = c.cost + r * c.width
    cdef int64_t peak = max(c.wa[t] + c.wabar[i] + c.of[i], c.wa[s] + c.wabar[i] + c.wa[s - 1] + c.ob[i])
    # The row is all inf so far, and rest is inf below its first (the reference leaves inf, -1)
    for m in range(max(peak, below + c.info[r].first), c.width):
        cost[m] = c.uf[i] + rest[m - below] + c.ub[i]
        choice[m] = 0


cdef inline void _rotor_prefetch(_Chain* c, Py_ssize_t s, Py_ssize_t sp, Py_ssize_t t,
                                 Py_ssize_t lo) noexcept nogil:
    """Start loading the first slots split sp will likely read (from about lo on)."""
    cdef const double* rt = c.cost + _rotor_row(c.n, sp, t) * c.width
    cdef const double* lf = c.cost + _rotor_row(c.n, s, sp - 1) * c.width
    cdef Py_ssize_t m, k = max(lo - c.wa[sp - 1], 0)
    for m in range(lo, min(lo + _PREFETCH, c.width), 8):  # 8 doubles: a 64-byte cache line
        __builtin_prefetch(lf + m)
    for m in range(k, min(k + _PREFETCH, c.width), 8):
        __builtin_prefetch(rt + m)


cdef void _rotor_fck(_Chain* c, Py_ssize_t s, Py_ssize_t t) noexcept nogil:
    """The reference's loops over s' and m, skipping only m where split s' cannot be strictly
    better than the row so far (the reference's test), so values and choices stay the same.

    Every C_BP row is nonincreasing in m, and so is the row being built (a minimum of such
    rows). Floating-point addition is monotone, so on m in a block [a, b) the split's value
    fwd_time + right[m - held] + left[m] is at least its value at b - 1, and the row is at most
    cost[a]: if cost[a] is no larger, the block is skipped. Likewise with the rows' least
    values (at m = slots) for all m at once: the loop stops at the first cost[a] <= bound.
    Below lo the split is infeasible (inf, never better)."""
    cdef Py_ssize_t a, b, sp, m, lo, right, left, held, slots = c.width - 1
    cdef double* cost = c.cost + _rotor_row(c.n, s, t) * c.width
    cdef int* choice = c.choice + _rotor_row(c.n, s, t) * c.width
    cdef const double* rt
    cdef const double* lf
    cdef int64_t fwd_peak = c.wa[t] + c.wa[s] + c.of[s - 1]
    cdef double fwd_time = 0.0, x, bound
    for sp in range(s + 1, t + 1):
        if sp > s + 1:
            fwd_peak = max(fwd_peak, c.wa[t] + c.wa[sp - 2] + c.wa[sp - 1] + c.of[sp - 2])
        fwd_time += c.uf[sp - 2]
        if fwd_peak > slots:
            break
        right = _rotor_row(c.n, sp, t)
        left = _rotor_row(c.n, s, sp - 1)
        held = c.wa[sp - 1]
        lo = max(max(<Py_ssize_t> fwd_peak, held), max(c.info[left].first, held + c.info[right].first))
        if lo > slots:
            continue
        if sp < t:
            _rotor_prefetch(c, s, sp + 1, t, lo)
        rt = c.cost + right * c.width
        lf = c.cost + left * c.width
        bound = fwd_time + c.info[right].least + c.info[left].least
        a = lo
        while a < c.width and cost[a] > bound:
            b = min(c.width, (a // _SLOT_BLOCK + 1) * _SLOT_BLOCK)
            if cost[a] > fwd_time + rt[b - 1 - held] + lf[b - 1]:
                for m in range(a, b):
                    x = fwd_time + rt[m - held] + lf[m]
                    if x < cost[m]:
                        cost[m] = x
                        choice[m] = <int> sp
            a = b


cdef void _rotor_pair(_Chain* c, Py_ssize_t s, Py_ssize_t t) noexcept nogil:
    cdef Py_ssize_t r = _rotor_row(c.n, s, t), m
    cdef double* cost = c.cost + r * c.width
    cdef int* choice = c.choice + r * c.width
    for m in range(c.width):
        cost[m], choice[m] = _INF, -1
    if s == t:
        _rotor_leaf(c, s)
    else:
        _rotor_fall(c, s, t)
        _rotor_fck(c, s, t)
    c.info[r].first = _rotor_first_at_most(cost, 0, c.width, DBL_MAX)
    c.info[r].least = cost[c.width - 1]


def rotor_table(uf, ub, wa_slots, wabar_slots, of_slots, ob_slots, slots):
    """C_BP and its argmin for every sub-chain; same contract and equal arrays as the
    reference :func:`fxremat.solvers.rotor.rotor_table` (times as doubles, added in the same
    order, splits tried in the same order). Two departures that change no value or choice:
    rows are computed a block of start stages at a time (each row still after the rows it
    reads), so the rows they share stay in cache; and each F_ck split only visits the m where
    it can be strictly better than the row so far."""
    cdef Py_ssize_t n = len(uf), width = slots + 1, s, t, rows, top, bottom
    cdef double[::1] fu = _array.array("d", [float(x) for x in uf])
    cdef double[::1] fb = _array.array("d", [float(x) for x in ub])
    cdef int64_t[::1] wa = _array.array("q", wa_slots)
    cdef int64_t[::1] wabar = _array.array("q", wabar_slots)
    cdef int64_t[::1] of = _array.array("q", of_slots)
    cdef int64_t[::1] ob = _array.array("q", ob_slots)
    cdef _Chain c
    if not (fb.shape[0] == wabar.shape[0] == of.shape[0] == ob.shape[0] == n and wa.shape[0] == n + 1):
        raise ValueError("fxremat._dp.rotor_table: uf, ub, wabar, of, ob need L entries and wa L + 1")
    if slots < 0 or min(min(wa), min(wabar, default=0), min(of, default=0), min(ob, default=0)) < 0:
        raise ValueError("fxremat._dp.rotor_table: sizes and slots must be non-negative")
    rows = n * (n + 1) // 2
    cdef array.array cost = array.clone(_array.array("d"), rows * width, zero=False)
    cdef array.array choice = array.clone(_array.array("i"), rows * width, zero=False)
    if n == 0:
        return cost, choice
    c.n, c.width = n, width
    c.uf, c.ub, c.wa, c.wabar, c.of, c.ob = &fu[0], &fb[0], &wa[0], &wabar[0], &of[0], &ob[0]
    c.cost, c.choice = cost.data.as_doubles, choice.data.as_ints
    c.info = <_RowInfo*> malloc(rows * sizeof(_RowInfo))
    if c.info == NULL:
        raise MemoryError()
    try:
        with nogil:
            top = n
            while top >= 1:
                bottom = max(1, top - _STAGE_BLOCK + 1)
                for t in range(bottom, n + 1):
                    for s in range(min(top, t), bottom - 1, -1):
                        _rotor_pair(&c, s, t)
                top = bottom - 1
        return cost, choice
    finally:
        free(c.info)
