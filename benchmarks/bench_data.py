"""Input pipeline throughput and packing efficiency for the default dataset configs.

    python benchmarks/bench_data.py [--data_dir DIR] [--batches 100] [--out results.json]

For each dataset (built-in EN->FR translation, standard-library LM) it builds the dataset and
tokenizer if needed (first run: tens of seconds), then times ``--batches`` training batches with
the default config. Reported per dataset:

* ``tokens_per_s``: real (non-padding) tokens per second, source and target together;
* ``rows_per_s``, ``batches_per_s``;
* ``packing_efficiency``: share of token slots holding real tokens (target >= 0.9), packed,
  and the same share without packing for comparison.

Prints one JSON object (and writes it to ``--out`` when given).
"""

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import grain  # noqa: E402

from benchmarks.cli import check_out_file, positive_int, write_json  # noqa: E402
from transformer_jax.data import inputs  # noqa: E402


def measure(cfg, workdir, num_batches):
    data = inputs.build_datasets(cfg, workdir, shard=grain.sharding.ShardOptions(0, 1))
    it = data.train_iter
    for _ in range(3):  # warm up: start the reader threads, fill the packer
        next(it)
    real = slots = rows = 0
    start = time.perf_counter()
    for _ in range(num_batches):
        batch = next(it)
        for key in ("inputs", "targets"):
            if key in batch:
                real += int((batch[f"{key}_segment_ids"] > 0).sum())
                slots += batch[key].size
        rows += batch["targets"].shape[0]
    seconds = time.perf_counter() - start
    return {
        "tokens_per_s": round(real / seconds),
        "rows_per_s": round(rows / seconds, 1),
        "batches_per_s": round(num_batches / seconds, 2),
        "packing_efficiency": round(real / slots, 4),
        "vocab_size": data.tokenizer.vocab_size,
        "train_examples": data.train_size,
    }


# Every dataset the pipeline knows but those read from the user's own files (no flag names files here).
DATASETS = tuple(name for name in inputs.DATASET_NAMES if name not in ("tsv", "text"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=os.path.expanduser("~/tensorflow_datasets"))
    parser.add_argument("--workdir", default=None, help="tokenizer cache (default: a temp dir)")
    parser.add_argument("--batches", type=positive_int, default=100)
    parser.add_argument("--datasets", default="enfr_builtin,stdlib_lm",
                        help=f"comma-separated, of {', '.join(DATASETS)}")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    check_out_file(parser, args.out)
    names = args.datasets.split(",")
    unknown = [name for name in names if name not in DATASETS]
    if unknown:  # named before any dataset is built, not after the first ones
        parser.error(f"--datasets: unknown {', '.join(map(repr, unknown))}; choose from "
                     f"{', '.join(DATASETS)}")

    results = {"python": sys.version.split()[0], "cpus": os.cpu_count(), "datasets": {}}
    workroot = args.workdir or tempfile.mkdtemp(prefix="bench_data_")
    for name in names:
        entry = {}
        for pack in (True, False):
            cfg = inputs.default_dataset_config(name)
            cfg.data_dir = args.data_dir
            cfg.pack = pack
            r = measure(cfg, os.path.join(workroot, name), args.batches)
            if pack:
                entry.update(r, batch_size=cfg.batch_size,
                             row_length={"inputs": cfg.max_source_len,
                                         "targets": cfg.max_target_len}
                             if name != "stdlib_lm" else cfg.max_len)
            else:
                entry["unpacked_efficiency"] = r["packing_efficiency"]
                entry["unpacked_tokens_per_s"] = r["tokens_per_s"]
        results["datasets"][name] = entry
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        write_json(args.out, results)


if __name__ == "__main__":
    main()
