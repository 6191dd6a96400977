"""Multi-process start-up: argument resolution, cluster detection, and two real CPU processes."""

import os
import subprocess
import sys
import textwrap

import pytest
from processes import free_port

from transformer_jax import parallel
from transformer_jax.config import ConfigError
from transformer_jax.parallel import distributed


def test_environment_fills_missing_arguments():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"}
    assert distributed.resolve_arguments(env=env) == ("10.0.0.1:1234", 4, 3)
    assert distributed.resolve_arguments("h:1", 2, 0, env=env) == ("h:1", 2, 0)
    assert distributed.resolve_arguments(env={}) == (None, None, None)


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, None),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "16"}, "slurm"),
        ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, None),
        ({"OMPI_COMM_WORLD_SIZE": "4"}, "mpi"),
        ({"TPU_WORKER_HOSTNAMES": "w0,w1,w2,w3"}, "tpu"),
        ({"TPU_WORKER_HOSTNAMES": "localhost"}, None),
        ({"MEGASCALE_COORDINATOR_ADDRESS": "10.0.0.1:8080"}, "tpu"),  # multi-slice
    ],
)
def test_detect_cluster(env, expected):
    assert distributed.detect_cluster(env) == expected


def test_a_non_integer_process_count_names_its_variable(monkeypatch):
    """int()'s bare "invalid literal for int() with base 10: 'two'" named nothing; train.py shows
    this one as an 'error:' line with status 2."""
    from transformer_jax.config import ConfigError

    with pytest.raises(ConfigError, match=r"environment variable JAX_NUM_PROCESSES='two' must be an integer"):
        distributed.resolve_arguments(None, None, None, {"JAX_NUM_PROCESSES": "two"})
    with pytest.raises(ConfigError, match=r"SLURM_NTASKS='4x' must be an integer"):
        distributed.detect_cluster({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4x"})
    assert distributed.resolve_arguments(None, None, None, {"JAX_PROCESS_ID": " 3 "}) == (None, None, 3)


def test_single_process_is_a_no_op(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    monkeypatch.delenv("TPU_WORKER_HOSTNAMES", raising=False)
    assert parallel.initialize() is False
    assert parallel.initialize(num_processes=1) is False
    assert parallel.initialize(num_processes=1, process_id=0) is False
    # One process has index 0: any other is refused, as it is for more processes.
    from transformer_jax.config import ConfigError

    for index, message in ((7, r"--process_id \(\$JAX_PROCESS_ID\)=7 must be below num_processes=1 "
                                r"\(processes are numbered 0 to 0\)"),
                           (-1, r"--process_id \(\$JAX_PROCESS_ID\)=-1 must be >= 0")):
        with pytest.raises(ConfigError, match=message):
            parallel.initialize(num_processes=1, process_id=index)
    monkeypatch.setenv("JAX_PROCESS_ID", "3")
    with pytest.raises(ConfigError, match="=3 must be below num_processes=1"):
        parallel.initialize(num_processes=1)
    assert parallel.is_primary()
    parallel.sync_global("single process barrier")  # returns at once


def test_initialize_passes_the_settings_and_auto_detects_unless_forbidden(monkeypatch):
    """A detected cluster starts jax.distributed with no address (JAX reads the scheduler's
    variables) unless auto=False; explicit arguments and the heartbeat setting reach JAX."""
    calls = []
    monkeypatch.setattr(distributed.jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)  # the job the coordinator formed
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "OMPI_COMM_WORLD_SIZE",
                 "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("TJ_HEARTBEAT_TIMEOUT_S", "30")
    assert parallel.initialize(auto=False) is False and calls == []
    assert parallel.initialize(initialization_timeout=9) is True
    assert parallel.initialize("h:1", 2, 1, heartbeat_timeout_seconds=5) is True
    common = dict(local_device_ids=None)
    assert calls == [
        dict(coordinator_address=None, num_processes=None, process_id=None, **common,
             initialization_timeout=9, heartbeat_timeout_seconds=30),
        dict(coordinator_address="h:1", num_processes=2, process_id=1, **common,
             initialization_timeout=300, heartbeat_timeout_seconds=5),
    ]
    # A process told another count than the job it joined has (it trained on, as if it were right).
    with pytest.raises(ConfigError, match=r"num_processes=3 on this process \(process_id=1\), but the job "
                                          r"the coordinator h:1 started has 2 processes"):
        parallel.initialize("h:1", 3, 1)


def test_process_0_names_a_coordinator_port_that_is_taken_or_malformed(monkeypatch):
    """Process 0 serves the coordinator at the address's port: another program listening there
    is a ConfigError naming the address, before JAX's runtime (which logged one gRPC line and
    crashed the process with a segmentation fault, the other processes waiting in silence). A
    port another process would use is not checked on processes 1 and up; a free one passes."""
    import socket

    calls = []
    monkeypatch.setattr(distributed.jax.distributed, "is_initialized", lambda: False)
    monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(distributed.jax, "process_count", lambda: 2)
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"--coordinator_address .*'127.0.0.1:{port}': port {port} "
                                              r"on this host .* is in use by another program"):
            parallel.initialize(f"127.0.0.1:{port}", 2, 0)
        assert calls == []
        assert parallel.initialize(f"127.0.0.1:{port}", 2, 1) is True  # process 1 only connects there
    for address in ("127.0.0.1", "127.0.0.1:http", "127.0.0.1:0", "127.0.0.1:70000", ":1234"):
        with pytest.raises(ConfigError, match="must be host:port with a port from 1 to 65535"):
            parallel.initialize(address, 2, 0)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:  # a port free a moment ago
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert parallel.initialize(f"127.0.0.1:{port}", 2, 0) is True
    assert [call["process_id"] for call in calls] == [1, 0]


# A small encoder-decoder (random weights) and a word tokenizer ("w5 w6" <-> [5, 6]), built alike in
# the two-process worker and in the test that compares its translations with one process's.
TRANSLATOR = textwrap.dedent(
    """
    def tiny_translator():
        import flax.linen as nn
        import jax
        import numpy as np
        import transformer_jax as tj

        model = tj.Transformer(tj.presets.tiny(vocab_size=64, max_len=16))
        ids = np.ones((1, 4), np.int32)
        return model, nn.unbox(model.init(jax.random.key(3), ids, ids)["params"])


    class Words:
        def encode(self, text):
            return [int(w[1:]) for w in text.split()]

        def decode_batch(self, rows):
            return [" ".join(f"w{i}" for i in r) for r in rows]


    PAIRS = [{"src": f"w{10 + i} w{20 + i}", "tgt": f"w{30 + i}"} for i in range(8)]
    """
)

WORKER = TRANSLATOR + textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, numpy as np
    from transformer_jax import parallel

    assert parallel.initialize(initialization_timeout=60)
    assert jax.process_count() == 2 and jax.device_count() == 4
    from transformer_jax.config import ConfigError
    try:  # the tensor axis across the two processes: both would hold the whole batch
        parallel.check_batch_divisible(8, parallel.create_mesh(data=1, tensor=-1))
        raise AssertionError("a batch that the processes would hold twice was accepted")
    except ConfigError as e:
        assert "hold the same rows of the batch" in str(e), e
    mesh = parallel.create_mesh(data=-1)
    parallel.check_batch_divisible(8, mesh)
    rank = jax.process_index()
    local = {"targets": np.full((4, 3), rank, np.int32)}
    batch = parallel.shard_batch(local, mesh)
    assert batch["targets"].shape == (8, 3)
    total = jax.jit(lambda x: x.sum())(batch["targets"])
    parallel.sync_global("after sum")

    # Translations of a split sharded over both processes come back in split order: each process
    # holds a contiguous half, two batches of two rows, and the global batches interleave them.
    import grain
    from transformer_jax.data import pipeline
    from transformer_jax.training import evaluate

    batches = pipeline.make_eval_batches(
        PAIRS, Words(), pipeline.Features({"inputs": "src", "targets": "tgt"}), {"inputs": 4, "targets": 4},
        2, shard=grain.sharding.ShardOptions(rank, 2))
    assert len(batches) == 2, len(batches)
    # The decoder's output: the source's words shifted by 10 (EOS and padding kept).
    real_decode_batch = evaluate.decode_batch
    evaluate.decode_batch = lambda model, params, src, seg, **kw: jax.numpy.where(src > 1, src + 10, src)
    out = evaluate.translate(None, None, batches, Words(), mesh, max_new_tokens=4)
    assert out.sources == [p["src"] for p in PAIRS], out.sources
    assert out.references == [p["tgt"] for p in PAIRS], out.references
    assert out.hypotheses == [f"w{20 + i} w{30 + i}" for i in range(8)], out.hypotheses
    # The real decoder (the test compares with one process's): the model's eager id check reads
    # a source batch that spans both processes.
    evaluate.decode_batch = real_decode_batch
    model, params = tiny_translator()
    from jax.sharding import NamedSharding, PartitionSpec
    params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
    out = evaluate.translate(model, params, batches, Words(), mesh, max_new_tokens=4)
    hypotheses = out.hypotheses
    # An id outside the vocabulary in one process's rows: both processes name it at its place in
    # the global batch (a check of local rows only would stop one and leave the other waiting).
    from transformer_jax.decoding.model_steps import encode_source
    local = np.full((4, 3), 5, np.int32)
    if rank == 1:
        local[2, 1] = 99
    try:
        encode_source(model, params, parallel.shard_batch({"inputs": local}, mesh)["inputs"], 4)
        raise AssertionError("an id past the vocabulary was accepted")
    except ValueError as e:
        assert "token id 99 (at (6, 1))" in str(e), e
    # Configs: the fields whose values differ between the processes are named, on each process.
    same = {"optimizer": {"learning_rate": 0.003, "b2": 0.98}, "dataset": {"data_dir": f"/d{rank}"}}
    assert parallel.config_differences(same, ignore=("dataset.data_dir",)) == []
    other = {"optimizer": {"learning_rate": 0.003 * (1 + 9 * rank), "b2": 0.98}, "steps": 4}
    assert parallel.config_differences(other) == [
        f"optimizer.learning_rate (this process: {other['optimizer']['learning_rate']!r})"]
    extra = dict(other, **({"model": {"d_ff": 128}} if rank else {}))
    assert parallel.config_differences(extra)[0].startswith("the set of config fields")
    # The validation loss over many batches, each batch's sums a program whose all-reduce crosses
    # the processes, run one at a time here (queued together they could hang both processes in
    # gloo under load: test_train.py checks the waiting); the figure is the whole split's.
    w = jax.device_put(np.eye(256, dtype=np.float32), NamedSharding(mesh, PartitionSpec()))

    @jax.jit
    def eval_step(w, batch):
        y = jax.numpy.tanh(batch["targets"] @ w) @ w
        return {"loss_sum": y.sum(), "weight_sum": jax.numpy.float32(y.size), "nll": (y * y).sum(),
                "z_loss": jax.numpy.float32(0), "correct": abs(y).sum()}

    eval_batches = [{"targets": np.full((4, 64, 256), (i + rank) % 3, np.float32)} for i in range(40)]
    loss = evaluate.evaluate_loss(eval_step, w, eval_batches, mesh)
    # Rows of value v in {0, 1, 2} give tanh(v) each; 40 batches of 8 rows over both processes.
    counts = np.bincount([(i + r) % 3 for i in range(40) for r in (0, 1)], minlength=3)
    expected = float((counts * np.tanh(np.arange(3))).sum() / counts.sum())
    assert abs(loss["eval_loss"] - expected) < 1e-5, (loss, expected)

    # Written to a file of its own: the C++ runtime logs to the same pipe as stdout.
    with open(os.environ["RESULT_FILE"] + str(rank), "w") as f:
        print("RESULT", rank, parallel.is_primary(), int(total), parallel.describe_mesh(mesh), file=f)
    with open(os.environ["RESULT_FILE"] + f"hypotheses_{rank}", "w") as f:
        f.write("\\n".join(hypotheses))
    parallel.leave_and_exit(0)  # as train.py ends (interpreter teardown can hang after such a run)
    """
)


def test_stop_child_processes_ends_worker_processes():
    """A multi-process run exits with os._exit, which skips multiprocessing's clean-up: the input
    pipeline's worker processes must be ended first, or they outlive the job."""
    import multiprocessing
    import time

    worker = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(600,), daemon=False)
    worker.start()
    try:
        assert worker.is_alive()
        parallel.stop_child_processes(timeout_s=20)
        assert not worker.is_alive() and worker.exitcode is not None
    finally:
        if worker.is_alive():
            worker.kill()


def test_two_cpu_processes_form_one_mesh(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "SLURM_"))}
    base["PYTHONPATH"] = repo
    base["JAX_COORDINATOR_ADDRESS"] = f"127.0.0.1:{free_port()}"
    base["JAX_NUM_PROCESSES"] = "2"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**base, "JAX_PROCESS_ID": str(i), "RESULT_FILE": str(tmp_path / "result_")},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outputs.append(out)
        assert p.returncode == 0, out
    lines = [(tmp_path / f"result_{i}").read_text().strip() for i in range(2)]
    # rows of process 1 hold 1s: 4 rows * 3 columns = 12
    assert lines[0].startswith("RESULT 0 True 12 mesh data=4 fsdp=1 tensor=1 | 4 cpu devices, 2 proc")
    assert lines[1].startswith("RESULT 1 False 12")
    # Both processes return the whole split's translations, equal to one process's.
    import jax

    from transformer_jax.data import pipeline
    from transformer_jax.training import evaluate

    names = {}
    exec(TRANSLATOR, names)
    model, params = names["tiny_translator"]()
    batches = pipeline.make_eval_batches(
        names["PAIRS"], names["Words"](), pipeline.Features({"inputs": "src", "targets": "tgt"}),
        {"inputs": 4, "targets": 4}, 2)
    one_device = parallel.create_mesh(devices=jax.devices()[:1])
    expected = evaluate.translate(model, params, batches, names["Words"](), one_device,
                                  max_new_tokens=4).hypotheses
    assert len(expected) == 8 and len(set(expected)) > 1, expected
    for i in range(2):
        assert (tmp_path / f"result_hypotheses_{i}").read_text().split("\n") == expected


def test_training_refuses_configs_that_differ_between_processes(monkeypatch):
    """Two processes given different learning rates trained on, each applying its own update to
    arrays that should be the same on both (and logged one rate); a different num_train_steps hung
    in a collective, a different model aborted in gloo. train_and_evaluate compares the configs
    first (the gathering itself is tested in the two-process run above)."""
    from configs import tiny
    from transformer_jax.config import ConfigError
    from transformer_jax.training import loop

    seen = {}

    def differences(config, ignore=()):
        seen.update(config=config, ignore=ignore)
        return ["optimizer.learning_rate (this process: 0.03)"]

    monkeypatch.setattr(parallel, "config_differences", differences)
    monkeypatch.setattr(loop, "build_model", lambda *a: pytest.fail("built the model"))
    config = tiny.get_config()
    with pytest.raises(ConfigError, match=r"processes were given different configs or workdirs .*differing: "
                                          r"optimizer.learning_rate \(this process: 0.03\)"):
        loop.train_and_evaluate(config, "/nonexistent/workdir")
    # The workdir is compared too, as an absolute path (a relative one from different directories
    # is two workdirs).
    assert seen["config"] == {**config.to_dict(), "workdir": "/nonexistent/workdir"}
    assert seen["ignore"] == ("dataset.data_dir",)
    monkeypatch.chdir("/tmp")
    with pytest.raises(ConfigError, match="different configs or workdirs"):
        loop.train_and_evaluate(config, "runs/x")
    assert seen["config"]["workdir"] == "/tmp/runs/x"
    # A value that only one process has, and that is invalid there: compared before it is checked,
    # so every process names the difference (checked first, only the process with the bad value
    # said so, and the others waited in the comparison until the runtime aborted them, ~100 s).
    config.optimizer.learning_rate = -1.0
    with pytest.raises(ConfigError, match="different configs or workdirs"):
        loop.train_and_evaluate(config, "/nonexistent/workdir")
