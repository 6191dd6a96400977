"""Checkpoint averaging from the command line (section 6.1 of the paper).

    python -m transformer_jax.training.average --workdir=runs/wmt14_ende_base --last=5

writes ``runs/wmt14_ende_base/average_last5``, a workdir that ``transformer_jax.generate`` and
``restore_for_inference`` load like any other. Each step is verified against its integrity
manifest before it is averaged; a damaged step, a workdir without checkpoints or a ``--last``
below 1 is one ``error:`` line and exit status 2.
"""

import os
import sys

from absl import app, flags, logging

from transformer_jax.training.checkpoint import average_checkpoints

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir with checkpoints.", required=True)
_LAST = flags.DEFINE_integer("last", 5, "How many of the newest checkpoints to average (>= 1).")
_OUTPUT = flags.DEFINE_string("output", None, "Output workdir (default WORKDIR/average_lastK).")


def main(argv):
    if len(argv) > 1:
        print(f"error: unexpected arguments {list(argv[1:])} (flags are --name=value)", file=sys.stderr)
        sys.exit(2)
    if not flags.FLAGS["verbosity"].present:  # the checkpoint library's INFO logs only on request
        logging.set_verbosity(logging.WARNING)
    try:
        # `--workdir=~/run`: the shell leaves a '~' after '=' as it is (train.py expands it too)
        output = os.path.expanduser(_OUTPUT.value) if _OUTPUT.value else None
        print(average_checkpoints(os.path.expanduser(_WORKDIR.value), _LAST.value, output))
    except (ValueError, OSError) as e:  # a workdir, step or output problem, named in the message
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    app.run(main)
