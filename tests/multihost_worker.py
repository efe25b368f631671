"""One process of the two-process test (tests/test_multihost.py): 4 virtual CPU devices per process,
joined with jax.distributed over loopback into one 8-device mesh; writes the tokens it got."""
import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ.setdefault("EAGLE2_JAX_COMPILE_CACHE", "0")

import jax  # noqa: E402

jax.config.update("jax_cpu_collectives_implementation", "gloo")


def main():
    pid, port, out, spec = int(sys.argv[1]), sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    import eagle2_jax as e2
    mesh = e2.make_mesh(data=spec["data"], model=spec["model"])
    target = e2.init_target(e2.ModelConfig(**spec["config"]), 0, mesh=mesh)
    draft = e2.init_draft(target, 1)
    tree = e2.TreeConfig(*spec["tree"])
    eagle = e2.generate(target, draft, spec["prompts"], max_new_tokens=spec["max_new"], tree=tree)
    plain = e2.generate_vanilla(target, spec["prompts"], max_new_tokens=spec["max_new"])
    with open(out, "w") as f:
        json.dump({"eagle": eagle.tokens, "plain": plain.tokens, "process": jax.process_index()}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
