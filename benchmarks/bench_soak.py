"""A long training run's resources over time: resident memory, threads, open files, disk.

    python benchmarks/bench_soak.py [--steps 3000] [--checkpoint-every 10] [--out soak.json]

Runs ``train.py --config=configs/tiny.py`` in a child process for ``--steps`` steps with a
checkpoint every ``--checkpoint-every`` steps (5 kept), samples the child's ``/proc`` entries every
``--interval`` seconds, and prints one JSON object (also written to ``--out``):

* ``rss_mb_first`` / ``rss_mb_last``: resident memory at the first sample after the first
  checkpoint and at the last sample before the last checkpoint (after it, the run's final
  evaluation);
* ``rss_kb_per_checkpoint``: the least-squares slope of resident memory against checkpoints saved,
  over the last three quarters of those samples (the first quarter holds caches filling and the
  allocator settling); what a run of days grows by with each save;
* ``threads`` and ``open_files``: the lowest and highest count seen;
* ``checkpoints_on_disk`` and ``orbax_temporaries`` left in the workdir at the end;
* ``series``: every sample as [seconds, checkpoints saved, resident MB].

The dataset and tokenizer are built into ``--data-dir`` on the first run (a few seconds). Linux
only (it reads ``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks.cli import check_out_file, positive_float, positive_int, write_json  # noqa: E402


def _status(pid: int) -> dict[str, float] | None:
    """The child's resident memory (MB), threads and open files, or None once it has ended."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        files = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError):
        return None
    if "VmRSS" not in fields:  # ended, not yet reaped
        return None
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "threads": int(fields["Threads"]),
            "open_files": files}


def _latest_step(checkpoints: str) -> int:
    try:
        return max((int(name) for name in os.listdir(checkpoints) if name.isdigit()), default=0)
    except FileNotFoundError:
        return 0


def slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ys against xs (None for fewer than two distinct xs)."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def run(steps: int, checkpoint_every: int, workdir: str, data_dir: str, interval: float) -> dict:
    command = [sys.executable, os.path.join(ROOT, "train.py"), f"--config={ROOT}/configs/tiny.py",
               f"--workdir={workdir}", f"--config.dataset.data_dir={data_dir}",
               f"--config.num_train_steps={steps}", f"--config.checkpoint_every_steps={checkpoint_every}",
               f"--config.log_every_steps={max(1, steps // 20)}",
               f"--config.eval_every_steps={max(1, steps // 5)}"]
    checkpoints = os.path.join(workdir, "checkpoints")
    samples = []
    start = time.perf_counter()
    with open(os.path.join(workdir, "train.log"), "w") as log:
        child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            while child.poll() is None:
                status = _status(child.pid)
                saved = _latest_step(checkpoints) // checkpoint_every
                if status is not None and saved > 0:
                    samples.append({"seconds": round(time.perf_counter() - start, 1),
                                    "checkpoints": saved, **status})
                time.sleep(interval)
        finally:  # interrupted (Ctrl-C) or failed here: the training run does not go on unwatched
            if child.poll() is None:
                child.kill()
                child.wait()
    if child.returncode:
        with open(os.path.join(workdir, "train.log")) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"train.py exited with status {child.returncode}:\n{tail}")
    training = [s for s in samples if s["checkpoints"] < steps // checkpoint_every]  # before the final eval
    late = training[len(training) // 4:]
    if len(late) < 2:
        raise SystemExit(f"only {len(training)} samples between the first and the last checkpoint: "
                         "run more --steps")
    growth = slope([s["checkpoints"] for s in late], [s["rss_mb"] for s in late])
    temporaries = [name for name in os.listdir(checkpoints) if re.search(r"tmp", name)]
    return {
        "steps": steps,
        "checkpoint_every": checkpoint_every,
        "checkpoints_saved": steps // checkpoint_every,
        "seconds": round(time.perf_counter() - start, 1),
        "samples": len(samples),
        "rss_mb_first": round(training[0]["rss_mb"], 1),
        "rss_mb_last": round(training[-1]["rss_mb"], 1),
        "rss_kb_per_checkpoint": None if growth is None else round(growth * 1024, 1),
        "threads": [min(s["threads"] for s in samples), max(s["threads"] for s in samples)],
        "open_files": [min(s["open_files"] for s in samples), max(s["open_files"] for s in samples)],
        "checkpoints_on_disk": len([name for name in os.listdir(checkpoints) if name.isdigit()]),
        "orbax_temporaries": temporaries,
        "series": [[s["seconds"], s["checkpoints"], round(s["rss_mb"], 2)] for s in samples],
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=positive_int, default=3000)
    parser.add_argument("--checkpoint-every", type=positive_int, default=10)
    parser.add_argument("--interval", type=positive_float, default=0.5, help="seconds between samples")
    parser.add_argument("--workdir", default=None, help="the run's workdir (default: a new temporary one)")
    parser.add_argument("--data-dir", default=os.path.join("~", "tensorflow_datasets"))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if not os.path.isdir("/proc/self"):
        parser.error("this benchmark reads /proc: Linux only")
    if args.checkpoint_every > args.steps:
        parser.error(f"--checkpoint-every {args.checkpoint_every} is more than --steps {args.steps}")
    check_out_file(parser, args.out)
    workdir = args.workdir or tempfile.mkdtemp(prefix="soak-")
    os.makedirs(workdir, exist_ok=True)
    result = run(args.steps, args.checkpoint_every, os.path.abspath(workdir),
                 os.path.expanduser(args.data_dir), args.interval)
    print(json.dumps(result, indent=1))
    if args.out:
        write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
