"""Shared fixtures: tiny random Hugging Face models of each family, saved to disk; the tests' seeded
random draws (`seeded_rng`, the ``rng`` fixture, ``pytest --seed N``)."""

from __future__ import annotations

import gc
import os
import secrets
import sys
import zlib
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# XLA:CPU's cheapest compile settings: the suite compiles many small programs and runs few large ones, so
# compilation dominates. With them and the compile cache below, the suite took 12.7 min on 2 idle cores
# (29.3 min before; the cache alone: 20.8 min); a real-model test runs slower (SmolLM2's Quest needle test
# 24 s -> 63 s): a test that runs a real model asks for optimized programs (the ``optimized_xla`` fixture).
# Set XLA_FLAGS yourself to test with other settings. Single-threaded XLA:CPU execution on top of them
# (--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1: the 2 workers already use the 2 cores)
# changed nothing: four policy test files, 3 runs each in turn, wall ratio 1.007 (2026-11-29).
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false "
                                   "--xla_llvm_disable_expensive_passes=true")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# -- seeded random draws --------------------------------------------------------------------------
# One seed per run, fresh unless ``--seed N`` is given, printed in the header and with every failure.
# Every generator a test draws from is derived from it: `seeded_rng()` where a generator is made
# (a test, a helper, a fixture, a parametrize list) and the ``rng`` fixture. The same seed gives the
# same draws again for the same tests.

_SEEDS = {"run": None, "test": None, "in_call": False, "counts": {}}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--seed", type=int, default=None, metavar="N",
                     help="seed of the tests' random draws (default: a fresh one each run; it is printed in the "
                          "header and with each failure, to replay the draws)")
    parser.addoption("--every-case", action="store_true",
                     help="run every parametrization of the tests marked `share` (by default a run takes the "
                          "seeded share of them that `--seed` replays)")


def pytest_configure(config: pytest.Config) -> None:
    seed = config.getoption("--seed")
    workerinput = getattr(config, "workerinput", None)  # a pytest-xdist worker: the controller's seed
    if seed is None and workerinput is not None:
        seed = workerinput.get("sparsekv_seed")
    _SEEDS["run"] = secrets.randbits(31) if seed is None else int(seed)
    config.addinivalue_line("markers", "share(k): a run takes a seeded ceil(n / k) of the test's n parametrizations "
                                       "(`pytest_collection_modifyitems`; --every-case runs them all)")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:  # pytest-xdist: every worker draws from the controller's seed
    node.workerinput["sparsekv_seed"] = _SEEDS["run"]


def pytest_report_header(config: pytest.Config) -> str:
    share = ("every case of the `share` tests" if config.getoption("--every-case")
             else "a seeded share of the `share` tests' cases (--every-case: all)")
    return f"random seed: {_SEEDS['run']} (pytest --seed {_SEEDS['run']} replays the draws); {share}"


# -- a seeded share of a test's parametrizations --------------------------------------------------
# `@pytest.mark.share(k)` on a parametrized test whose cases check one property on k or more variants
# (policies, layouts, dtypes) that each compile their own programs: a run takes ceil(n / k) of its n
# cases, drawn from the run's seed, the others deselected (counted in pytest's summary). Across runs
# every case is drawn (one sits out m runs in a row with probability about (1 - 1/k)^m); `--seed N`
# gives a failing run's cases again, and `--every-case` (`make test-all`) runs them all. Why: the
# suite compiles thousands of small XLA programs on 2 cores, and CI's budget is 20 minutes.


@pytest.hookimpl(trylast=True)  # after -k / -m: a case picked by name is never dropped
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--every-case"):
        return
    groups: dict[str, list[pytest.Item]] = {}
    for item in items:
        marker = item.get_closest_marker("share")
        if marker is not None and hasattr(item, "callspec"):
            groups.setdefault(item.nodeid.split("[", 1)[0], []).append(item)
    dropped: set[str] = set()
    for name, cases in groups.items():
        k = cases[0].get_closest_marker("share").args[0]
        if not (isinstance(k, int) and k >= 1):
            raise pytest.UsageError(f"{name}: share(k) takes an integer k >= 1, got {k!r}")
        order = np.random.default_rng([_SEEDS["run"], zlib.crc32(name.encode())]).permutation(len(cases))
        kept = -(-len(cases) // k)  # ceil(n / k)
        dropped.update(cases[i].nodeid for i in order[kept:])
    if dropped:
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid in dropped])
        items[:] = [item for item in items if item.nodeid not in dropped]


def pytest_collectstart(collector: pytest.Collector) -> None:
    _SEEDS.update(test=None, in_call=False, counts={})


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _SEEDS.update(test=item.nodeid, in_call=False, counts={})
    item.user_properties.append(("seed", _SEEDS["run"]))  # in a JUnit XML report


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    _SEEDS["in_call"] = True
    try:
        yield
    finally:
        _SEEDS["in_call"] = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = (yield).get_result()
    if report.failed:
        report.sections.append(("random seed", f"this run drew from seed {_SEEDS['run']}; replay: "
                                               f"pytest {item.nodeid} --seed {_SEEDS['run']}"))


def load_script(path: Path, name: str):
    """A script or experiment of the repository (not a package module) imported from its file as ``name``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def seeded_rng() -> np.random.Generator:
    """A NumPy generator derived from the run's seed and where it is made: the file and line of the
    call, and how many were made there before in this test. In a test's body (directly or through a
    helper) the test's id is part of it too, so each test and each parametrization draws its own
    values; in a fixture or at collection it is not, so a fixture draws the same whichever test sets
    it up (a test run alone with ``--seed N`` sees what it saw in the whole run)."""
    caller = sys._getframe(1)
    where = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
    test = _SEEDS["test"] if _SEEDS["in_call"] else ""
    count = _SEEDS["counts"][where] = _SEEDS["counts"].get(where, -1) + 1
    run = _SEEDS["run"] if _SEEDS["run"] is not None else secrets.randbits(31)  # imported outside pytest
    return np.random.default_rng([run, zlib.crc32(where.encode()), zlib.crc32(test.encode()), count])


def decode_forced(params, session, forced: np.ndarray, ready=None) -> tuple[np.ndarray, np.ndarray]:
    """``(logits [B, N, V], pages_read [N - 1, B])`` of an `engine.Session` fed ``forced`` ``[B, N]`` (all but the
    last token) one jitted `engine.decode_step` at a time from ``ready`` (default: ``session.begin()``); the first
    logits are ``ready``'s. The step-by-step reading the pool tests compare with `teacher_force`'s."""
    from sparsekv_jax import engine

    ready = session.begin() if ready is None else ready
    step = jax.jit(lambda cache, token, state: engine.decode_step(params, session.run.policy, cache, token, state,
                                                                  backend=session.run.backend))
    logits, reads, cache, state = [ready.logits], [], ready.cache, ready.state
    for i in range(forced.shape[1] - 1):
        out = step(cache, jax.numpy.asarray(forced[:, i], jax.numpy.int32), state)
        logits, reads, cache, state = logits + [out.logits], reads + [out.pages_read], out.cache, out.state
    return np.stack([np.asarray(x) for x in logits], 1), np.stack([np.asarray(x) for x in reads])


def decode_rewinding(params, session, steps: int) -> dict:
    """``session`` (CHESS, or a pipeline ending in it) decoded greedily for ``steps`` `engine.decode_step`s from
    ``session.begin()``, every row active, each step's rewind applied as `decode.decode_loop` does (the row's tokens
    taken back, the next token fed the last one kept): per step the logits ``[steps + 1, B, V]`` (``begin``'s
    first), pages read, rewinds, and after the rewind the lengths (``[B]``; a pool's ``[L, B, Hkv]``) and, on a
    pool, the pages held and free before and after it; ``"cache"``, the last cache; ``"free_after_begin"``, a
    pool's free pages after ``begin`` (``None`` on the uniform layout)."""
    from sparsekv_jax import engine
    from sparsekv_jax.cache_pooled import PoolCache, rewind_pool

    ready = session.begin()
    step = jax.jit(lambda cache, token, state: engine.decode_step(params, session.run.policy, cache, token, state,
                                                                  backend=session.run.backend))
    cache, state = ready.cache, ready.state
    pooled = isinstance(cache, PoolCache)
    free_after_begin = int(cache.alloc.num_free) if pooled else None
    history = [[int(t)] for t in np.argmax(np.asarray(ready.logits), -1)]
    rec = {k: [] for k in ("logits", "read", "rewind", "lengths", "held_before", "held", "free_before", "free")}
    rec["logits"].append(np.asarray(ready.logits))
    for _ in range(steps):
        out = step(cache, jax.numpy.asarray([h[-1] for h in history], jax.numpy.int32), state)
        cache, state = out.cache, out.state
        rewind = np.asarray(state[1]["rewind"])
        for h, t, r in zip(history, np.argmax(np.asarray(out.logits), -1), rewind, strict=True):
            h.append(int(t))
            del h[len(h) - int(r):]
        back = jax.numpy.asarray(rewind, jax.numpy.int32)
        if pooled:
            rec["held_before"].append(np.asarray(cache.alloc.held).reshape(cache.lengths.shape))
            rec["free_before"].append(int(cache.alloc.num_free))
            cache = rewind_pool(cache, back)
            rec["held"].append(np.asarray(cache.alloc.held).reshape(cache.lengths.shape))
            rec["free"].append(int(cache.alloc.num_free))
            rec["lengths"].append(np.asarray(cache.lengths))
        else:
            cache = cache.replace(length=cache.length - back, next_position=cache.next_position - back)
            rec["lengths"].append(np.asarray(cache.length))
        rec["logits"].append(np.asarray(out.logits))
        rec["read"].append(np.asarray(out.pages_read))
        rec["rewind"].append(rewind)
    out = {k: np.stack([np.asarray(x) for x in v]) if v else np.zeros(0) for k, v in rec.items()}
    return {**out, "cache": cache, "free_after_begin": free_after_begin}


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator for one test: the run's seed and the test's id."""
    return np.random.default_rng([_SEEDS["run"], zlib.crc32(request.node.nodeid.encode())])


@pytest.fixture(autouse=True, scope="session")
def _compilation_cache(tmp_path_factory):
    """One persistent XLA compilation cache for the session, shared by the pytest-xdist workers.

    Tests compile many programs that are the same XLA program under another Python name (another
    policy class whose stage is a no-op, the same fixture on each worker, a module's programs again
    after `_free_compiled_code`): JAX keys the cache by the program's text, so those are loaded, not
    compiled again. A fresh directory each session (under pytest's temporary root): nothing is
    carried over from an earlier run. The size limit turns on JAX's file lock (two workers write it).
    Caching every program (a threshold of 0 s, not 0.5 s) made test_chess + test_policies slower in one
    process (147 s against 121 s, 2026-11-29): 97 hits among 640 compiles, each read back slower than it compiled."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # common to every worker of this session
    jax.config.update("jax_compilation_cache_dir", str(root / "xla_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    jax.config.update("jax_compilation_cache_max_size", 8 << 30)
    yield


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code():
    """Drop every compiled executable after each test module.

    XLA:CPU maps a few memory regions per compiled executable and never unmaps them while the
    executable is cached: the whole suite in one process passed the kernel's ``vm.max_map_count``
    (65,530 regions; ~20k after 60 tests) and the next compilation segfaulted inside XLA. Keeping
    them until the process maps 20k regions (so a module reuses an earlier one's programs) made ten
    pool test files slower, not faster (405 s against 374 s on 2 workers, 2026-11-29): modules
    share few programs."""
    yield
    jax.clear_caches()
    gc.collect()

# XLA:CPU's own (optimizing) settings, for the programs of a test that runs a real model
OPTIMIZED_XLA = {"xla_backend_optimization_level": 2, "xla_cpu_use_fusion_emitters": True,
                 "xla_llvm_disable_expensive_passes": False}


@pytest.fixture
def optimized_xla(monkeypatch):
    """The programs this test compiles get XLA:CPU's optimizing settings (`OPTIMIZED_XLA`), not the
    suite's cheap ones (``XLA_FLAGS`` above, which a process reads once).

    The cheap settings pay off for the many small programs of the suite, but a real model runs
    unoptimized code: SmolLM2 decoding 32 tokens after 512 took 16.6 CPU s warm (17.9 s with its
    compile) under them, 3.0 s (5.9 s) optimized. The settings go in as per-compile overrides (what
    ``jax.jit(...).lower(...).compile(compiler_options=...)`` passes), through JAX's
    ``compiler.get_compile_options``: a private function, so a JAX that renames it fails here
    loudly. Programs already compiled in this process are reused as they are (the in-memory caches
    key by function and shapes), and the persistent cache keys by the options, so nothing compiled
    one way is loaded for the other."""
    from jax._src import compiler

    real = compiler.get_compile_options

    def get_compile_options(*args, env_options_overrides=None, **kwargs):
        return real(*args, env_options_overrides={**OPTIMIZED_XLA, **(env_options_overrides or {})}, **kwargs)

    monkeypatch.setattr(compiler, "get_compile_options", get_compile_options)


def once_per_session(tmp_path_factory, name: str, make) -> Path:
    """``make(directory)`` run once a session, however many pytest-xdist workers ask: the directory it filled.

    A module fixture is set up once per worker, and `--dist worksteal` may deal a module's tests to
    both workers: an expensive fixture (a child process on forced devices, a peer library's run) would
    run twice. The first worker to get here runs ``make`` into a directory under the session's common
    temp root, behind a file lock; the others wait for it and get the same directory. If ``make``
    raises, nothing is marked done and the next worker runs it again (and fails the same way). Without
    xdist it is a plain call into a fresh temp directory."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        out = tmp_path_factory.mktemp(name)
        make(out)
        return out
    import fcntl

    root = tmp_path_factory.getbasetemp().parent  # common to every worker of this session
    out, done = root / f"once_{name}", root / f"once_{name}.done"
    with open(root / f"once_{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not done.exists():
                out.mkdir(exist_ok=True)
                make(out)
                done.touch()
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return out


TINY = dict(vocab_size=211, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=False)


def tiny_hf_config(family: str):
    """A tiny transformers config of ``family`` exercising that family's specific features."""
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(**TINY, rope_theta=10000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
    if family == "qwen2":
        return tf.Qwen2Config(**TINY, rope_theta=1e6)
    if family == "qwen3":
        return tf.Qwen3Config(**TINY, head_dim=16, rope_theta=1e6)
    if family == "mistral":
        return tf.MistralConfig(**TINY, sliding_window=24, rope_theta=1e4)
    if family == "gemma3":  # 7 layers: 5 local, 1 global, 1 local; a window far shorter than the tests' prompts
        cfg = dict(TINY, num_hidden_layers=7, tie_word_embeddings=True)
        return tf.Gemma3TextConfig(**cfg, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                                   final_logit_softcapping=30.0, rope_parameters={
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                       "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0}})
    raise ValueError(family)


@pytest.fixture(scope="session")
def hf_tiny_dir(tmp_path_factory):
    """``hf_tiny_dir(family)`` → directory of a saved random tiny model (built once per family)."""
    import torch
    import transformers as tf

    built: dict[str, str] = {}

    def make(family: str) -> str:
        if family not in built:
            torch.manual_seed(hash(family) % 2**31)
            model = tf.AutoModelForCausalLM.from_config(tiny_hf_config(family), torch_dtype=torch.float32)
            with torch.no_grad():  # larger than default init so layers actually matter
                for p in model.parameters():
                    if p.ndim == 2:
                        p.normal_(0, 0.08)
                    elif family == "gemma3":  # norms scale by 1 + w
                        p.copy_(0.1 * torch.randn_like(p))
                    else:
                        p.copy_(1 + 0.1 * torch.randn_like(p))
            path = tmp_path_factory.mktemp(f"tiny_{family}")
            model.save_pretrained(path)
            built[family] = str(path)
        return built[family]

    return make


@pytest.fixture(scope="session")
def smol(tmp_path_factory):
    """(cache_dir, params, tokenizer, seconds) of the first `load("smollm2")` into a fresh cache.

    Shared by every test that needs the real embedded model, so it is converted once a session.
    Under pytest-xdist the workers share one cache (under the session's common temp root, behind a
    file lock): the first worker to get there converts, and each worker loads from its own hard-linked
    copy of the finished entries; a worker that did not convert reports that cached load's ``seconds``.
    """
    import fcntl
    import time

    from sparsekv_jax.models.embedded import load

    cache = tmp_path_factory.mktemp("sparsekv_cache")
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import shutil

        root = tmp_path_factory.getbasetemp().parent  # common to every worker of this session
        shared, took = root / "sparsekv_cache_shared", None
        with open(root / "sparsekv_cache_shared.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (root / "sparsekv_cache_shared.done").exists():
                t0 = time.perf_counter()
                load("smollm2", cache_dir=shared, progress=False)
                took = time.perf_counter() - t0
                (root / "sparsekv_cache_shared.done").touch()
            fcntl.flock(lock, fcntl.LOCK_UN)
        # each worker gets its own cache (hard links to the finished entries): tests that write there stay apart
        shutil.copytree(shared, cache, copy_function=os.link, dirs_exist_ok=True)
        t0 = time.perf_counter()
        params, tok = load("smollm2", cache_dir=cache, progress=False)
        return cache, params, tok, took if took is not None else time.perf_counter() - t0
    t0 = time.perf_counter()
    params, tok = load("smollm2", cache_dir=cache, progress=False)
    return cache, params, tok, time.perf_counter() - t0
