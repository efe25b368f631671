"""Multi-host: two processes on this machine, 4 CPU devices each, joined with jax.distributed
(loopback, gloo collectives) into one 8-device mesh, produce the same tokens as one process."""
import json
import os
import socket
import subprocess
import sys

import pytest

import eagle2_jax as e2
from helpers import tiny_config

HERE = os.path.dirname(__file__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # keeps the default suite within its time (README, top)
@pytest.mark.parametrize("data,model", [(2, 4), (8, 1)])
def test_two_processes_one_mesh_same_tokens(tmp_path, data, model):
    cfg = tiny_config(vocab_size=64, num_key_value_heads=4)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [9, 8], [10, 11, 12, 13, 14], [3], [7, 7, 7], [20, 21], [30, 31, 32]]
    spec = dict(config={k: v for k, v in cfg.to_hf_dict().items() if k in cfg.__dataclass_fields__},
                data=data, model=model, tree=[3, 3, 8], max_new=12, prompts=prompts)
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
    env.pop("XLA_FLAGS", None)
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "multihost_worker.py"), str(i), str(port),
                               str(tmp_path / f"out{i}.json"), json.dumps(spec)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=600)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("multi-host workers timed out")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    target = e2.init_target(cfg, 0)  # one process, one device
    draft = e2.init_draft(target, 1)
    want_eagle = e2.generate(target, draft, prompts, max_new_tokens=12, tree=e2.TreeConfig(3, 3, 8)).tokens
    want_plain = e2.generate_vanilla(target, prompts, max_new_tokens=12).tokens
    assert want_eagle == want_plain
    for i in range(2):
        got = json.loads((tmp_path / f"out{i}.json").read_text())
        assert got["process"] == i
        assert got["eagle"] == want_eagle
        assert got["plain"] == want_plain
