"""localsgd.Client (the C++ client over pybind11) in jobs with C++ members:
exact results against an independent computation, the GIL released while
waiting, and every bad input refused with the documented error, changing
nothing."""
import threading

import numpy as np
import pytest

import localsgd

N = 1000
LAYOUT = [("w", [N], "float32")]  # scripted_member's layout


def py_client(coordinator, job, name, **kwargs):
    kwargs.setdefault("max_retry_time", 5.0)
    return localsgd.Client(target=coordinator.target, job=job,
                           member_name=name, **kwargs)


def in_parallel(*fns):
    """Runs the callables in threads (each blocks in a sync until the round
    closes: only possible if the binding releases the GIL); returns their
    results, re-raising the first exception."""
    results = [None] * len(fns)
    errors = []

    def run(i, fn):
        try:
            results[i] = fn()
        except BaseException as e:  # noqa: B902 - re-raised below
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i, fn))
               for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a sync did not return within 120 s"
    if errors:
        raise errors[0]
    return results


def test_two_python_two_cpp_members_hold_the_exact_weighted_mean(
        coordinator, cpp_member):
    c = coordinator()
    weights = {"cpp0": 1.0, "cpp1": 2.0, "py0": 1.0, "py1": 4.0}
    cpp = [cpp_member(c, "mixed", n, weight=weights[n]) for n in
           ("cpp0", "cpp1")]
    py = [py_client(c, "mixed", n, weight=weights[n]) for n in ("py0", "py1")]
    for m in cpp:
        m.do("join")
    for p in py:
        p.join(LAYOUT)
    arrays = [np.full(N, 1.0, dtype=np.float32) for _ in py]
    cpp[0].do("init 1")  # seeds: the state is all ones
    for p, a in zip(py, arrays):
        p.initialize(a)
        assert np.all(a == 1.0)
    cpp[1].do("init 1")
    state = np.full(N, 1.0, dtype=np.float32)
    rng = np.random.default_rng(7)
    total = sum(weights.values())
    for round_ in range(1, 6):
        # Round 1 exact in binary: deltas whose weighted sum divides by 8.
        if round_ == 1:
            cpp_values = [9.0, 17.0]
            py_values = [np.full(N, 25.0, np.float32),
                         np.full(N, 33.0, np.float32)]
        else:
            cpp_values = [float(round_ * 3), float(-round_)]
            py_values = [rng.standard_normal(N).astype(np.float32)
                         for _ in py]
        for a, v in zip(arrays, py_values):
            a[:] = v
        for m, v in zip(cpp, cpp_values):
            m.send(f"sync {v}")
        outcomes = in_parallel(*[lambda p=p, a=a: p.sync(a)
                                 for p, a in zip(py, arrays)])
        replies = [m.reply() for m in cpp]
        for o in outcomes:
            assert o["round"] == round_ and o["contributed"] and \
                o["contributors"] == 4 and not o["late"]
            assert o["bytes_sent"] == N * 4 and o["bytes_received"] == N * 4
        # Byte-identical across the Python members ...
        assert arrays[0].tobytes() == arrays[1].tobytes()
        # ... and the C++ members report the same first value.
        for line in replies:
            assert line.startswith("ok sync"), line
            assert f"round={round_} " in line
            # (scripted_member prints %g: 6 significant digits.)
            assert line.split("value=")[1].split()[0] == \
                f"{arrays[0][0]:g}", line
        # The independent computation: state + weighted mean of the deltas.
        deltas = [np.full(N, v, np.float64) - state for v in cpp_values] + \
            [v.astype(np.float64) - state for v in py_values]
        ws = [weights["cpp0"], weights["cpp1"], weights["py0"],
              weights["py1"]]
        expected = state + sum(w * d for w, d in zip(ws, deltas)) / total
        if round_ == 1:
            assert np.all(arrays[0] == 25.0)
        # float32 at the coordinator (in arrival order) against float64
        # here: a few ulps of values up to ~10.
        np.testing.assert_allclose(arrays[0], expected, rtol=0, atol=1e-5)
        state = arrays[0].astype(np.float64).copy()
        assert p.state_round == round_
    for p in py:
        p.leave()
        p.close()


def test_sync_releases_the_gil(coordinator):
    # Two members in one interpreter: each sync waits for the other's, so
    # they can only finish if the first releases the GIL while it waits.
    c = coordinator()
    a, b = py_client(c, "gil", "a"), py_client(c, "gil", "b")
    x, y = np.zeros(N, np.float32), np.zeros(N, np.float32)
    a.join(LAYOUT)
    b.join(LAYOUT)
    a.initialize(x)
    b.initialize(y)
    x[:] = 2.0
    y[:] = 4.0
    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(1)
            stop.wait(0.01)
    ticker = threading.Thread(target=tick)
    ticker.start()
    in_parallel(lambda: a.sync(x), lambda: b.sync(y))
    stop.set()
    ticker.join()
    assert np.all(x == 3.0) and np.all(y == 3.0)
    assert ticks, "no other Python thread ran during the syncs"


def test_unreachable_coordinator_raises_unavailable():
    client = localsgd.Client(target="127.0.0.1:1", job="j",
                             max_retry_time=0.3)
    with pytest.raises(localsgd.Error) as e:
        client.join(LAYOUT)
    assert e.value.code == "UNAVAILABLE"
    assert e.value.message and str(e.value).startswith("UNAVAILABLE: ")


def test_layout_mismatch_raises_failed_precondition(coordinator, cpp_member):
    c = coordinator()
    m = cpp_member(c, "layout", "cpp")
    m.do("join")
    other = py_client(c, "layout", "py")
    with pytest.raises(localsgd.Error) as e:
        other.join([("w", [N + 1], "float32")])
    assert e.value.code == "FAILED_PRECONDITION"
    assert "w" in e.value.message
    # Nothing changed: the right layout still joins.
    again = py_client(c, "layout", "py2")
    again.join(LAYOUT)


def test_bad_token_raises_with_its_code(coordinator, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("secure secret-token-1\n")
    c = coordinator(f"--token_file={tokens}")
    with pytest.raises(localsgd.Error) as e:
        py_client(c, "secure", "nobody").join(LAYOUT)
    assert e.value.code == "UNAUTHENTICATED"
    with pytest.raises(localsgd.Error) as e:
        py_client(c, "secure", "wrong", token="not-the-token").join(LAYOUT)
    assert e.value.code == "PERMISSION_DENIED"
    ok = py_client(c, "secure", "right", token="secret-token-1")
    ok.join(LAYOUT)
    ok.initialize(np.ones(N, np.float32))


def test_bad_inputs_raise_and_change_nothing(coordinator):
    c = coordinator()
    with pytest.raises(localsgd.Error) as e:
        localsgd.Client(target="", job="j")
    assert e.value.code == "INVALID_ARGUMENT"
    with pytest.raises(ValueError, match="wire_dtype=int3"):
        localsgd.Client(target=c.target, job="j", wire_dtype="int3")
    with pytest.raises(ValueError, match="averaging"):
        localsgd.Client(target=c.target, job="j", averaging="adam")
    with pytest.raises(ValueError, match="max_retry_time"):
        localsgd.Client(target=c.target, job="j", max_retry_time=-1)
    with pytest.raises(TypeError):
        localsgd.Client(c.target, "j")  # keyword-only
    p = py_client(c, "bad", "p")
    q = py_client(c, "bad", "q")
    params = np.zeros(N, np.float32)
    with pytest.raises(ValueError, match="join first"):
        p.sync(params)
    with pytest.raises(ValueError, match="dtype"):
        p.join([("w", [N], "int8")])
    with pytest.raises(localsgd.Error) as e:
        p.join([("w", [-1], "float32")])
    assert e.value.code == "INVALID_ARGUMENT"
    p.join(LAYOUT)
    q.join(LAYOUT)
    p.initialize(params)
    q_params = np.zeros(N, np.float32)
    q.initialize(q_params)
    with pytest.raises(TypeError, match="float32"):
        p.sync(np.zeros(N, np.float64))
    with pytest.raises(ValueError, match="holds 999 values"):
        p.sync(np.zeros(N - 1, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        p.sync(np.zeros(2 * N, np.float32)[::2])
    frozen = np.zeros(N, np.float32)
    frozen.setflags(write=False)
    with pytest.raises(TypeError, match="writable"):
        p.sync(frozen)
    with pytest.raises(TypeError):
        p.sync("not a buffer")
    # Local steps: a whole number in [0, 2^20] or None.
    for steps in (-1, 2.5, "16", True, 2**20 + 1, 2**70):
        with pytest.raises(ValueError, match="local_steps"):
            p.sync(params, local_steps=steps)
        with pytest.raises(ValueError, match="local_steps"):
            p.start_sync(params, local_steps=steps)
    with pytest.raises(ValueError, match="max_staleness"):
        localsgd.Client(target=c.target, job="j", max_staleness="65")
    with pytest.raises(ValueError, match="step_budget"):
        localsgd.Client(target=c.target, job="j", step_budget="sometimes")
    with pytest.raises(localsgd.Error) as e:
        p.sync(np.full(N, np.nan, np.float32))  # the job rejects non-finite
    assert e.value.code == "INVALID_ARGUMENT"
    # None of it reached the job: the next round averages exactly.
    params[:] = 2.0
    q_params[:] = 6.0
    outcomes = in_parallel(lambda: p.sync(params, local_steps=16),
                           lambda: q.sync(q_params, local_steps=0))
    assert [o["round"] for o in outcomes] == [1, 1]
    assert np.all(params == 4.0) and np.all(q_params == 4.0)
    assert [o["staleness"] for o in outcomes] == [0, 0]
    assert [o["local_steps_budget"] for o in outcomes] == [0, 0]
    p.close()
    with pytest.raises(ValueError, match="closed"):
        p.sync(params)
    p.close()  # idempotent
    p.leave()  # so is leave, after close too


def test_info_describes_the_job(coordinator):
    c = coordinator()
    p = py_client(c, "info", "p", wire_dtype="bfloat16", local_sgd_steps=4)
    p.join(LAYOUT)
    info = p.info
    assert info["num_elements"] == N and info["wire_dtype"] == "bfloat16"
    assert info["local_sgd_steps"] == 4
    assert info["contribution"] == "pseudo_gradients"
    assert info["mean_encoding"] == "float32"  # the coordinator's default
    assert not info["has_state"]
    w = py_client(c, "info-wire", "w", wire_dtype="int4",
                  mean_encoding="wire")
    w.join(LAYOUT)
    assert w.info["mean_encoding"] == "wire"
    # A member that asks for another is refused, naming both.
    with pytest.raises(localsgd.Error) as e:
        py_client(c, "info-wire", "f", wire_dtype="int4",
                  mean_encoding="float32").join(LAYOUT)
    assert e.value.code == "FAILED_PRECONDITION"
    assert "uses mean encoding wire; member asks for float32" in \
        e.value.message
    with pytest.raises(ValueError, match="mean_encoding"):
        py_client(c, "info-wire", "g", mean_encoding="int4")


def test_sparse_wire_members_agree_and_move_the_largest(coordinator):
    """Two Python members of a sparse2 job (8 of every 4096 kept, so 2 of
    this job's 1000 values): both hold the same bits after each round, and
    a round moves only the values the sparse code kept, the largest."""
    c = coordinator()
    p = py_client(c, "sparse", "p", wire_dtype="sparse2", sparse_keep=8,
                  rendezvous=2)
    q = py_client(c, "sparse", "q", wire_dtype="sparse2", rendezvous=2)
    p.join(LAYOUT)
    q.join(LAYOUT)
    assert p.info["wire_dtype"] == "sparse2" and p.info["sparse_keep"] == 8
    assert q.info["sparse_keep"] == 8  # the job's, unset by q
    a = np.zeros(N, np.float32)
    b = np.zeros(N, np.float32)
    in_parallel(lambda: p.initialize(a), lambda: q.initialize(b))
    a[:] = 1e-3
    a[[10, 500]] = [2.0, -3.0]
    b[:] = 1e-3
    b[[10, 500]] = [2.0, -3.0]
    in_parallel(lambda: p.sync(a), lambda: q.sync(b))
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
    moved = np.flatnonzero(a)
    assert list(moved) == [10, 500]
    assert a[10] > 0 and a[500] < 0
    # Another keep than the job's: refused, naming both.
    with pytest.raises(localsgd.Error) as e:
        py_client(c, "sparse", "r", wire_dtype="sparse2",
                  sparse_keep=64).join(LAYOUT)
    assert e.value.code == "FAILED_PRECONDITION"
    assert "keeps 8 values per sparse block; member asks for 64" in \
        e.value.message
    with pytest.raises(ValueError, match="wire_dtype"):
        py_client(c, "sparse", "s", wire_dtype="sparse3")
