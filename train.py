"""Trains a Transformer from a config file.

    python train.py                                   # configs/default.py into runs/default
    python train.py --config=configs/NAME.py --workdir=DIR --config.num_train_steps=2000

Multi-host: run the same command on every host. Cloud TPU, SLURM and Open MPI are detected;
elsewhere pass --coordinator_address, --num_processes and --process_id (or set the JAX_*
environment variables). Restarting with the same workdir resumes from the latest checkpoint.
"""

import os
import re
import signal
import sys
import traceback


def _restart_with_huge_page_malloc() -> None:
    """transformer_jax.host_memory.restart_with_huge_page_malloc() (large buffers on huge pages:
    ~12% off a GPT-2-small training step on a CPU), first thing: the --config file imports jax,
    which a restart after reading it would import a second time (~2 s of every start). The module
    is loaded from its file, without the package's __init__ (which imports jax too)."""
    import importlib.util

    package = importlib.util.find_spec("transformer_jax")
    if package is None or not package.submodule_search_locations:
        return  # not installed: the config's import names the problem
    path = os.path.join(list(package.submodule_search_locations)[0], "host_memory.py")
    spec = importlib.util.spec_from_file_location("_transformer_jax_host_memory", path)
    if spec is None or not os.path.isfile(path):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.restart_with_huge_page_malloc()  # returns where it does not restart


_INTERRUPTED_AT_START = []


def _remember_interrupt(signum, frame) -> None:
    """SIGINT's handler until the library is imported: a Ctrl-C while the config file loads is
    acted on once it has, in `_main`. Python's own handler raised it wherever it landed, and in
    JAX's garbage-collector callback (jax is imported with the config) that dropped it: the run
    trained to its end."""
    _INTERRUPTED_AT_START.append(signum)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, _remember_interrupt)
    _restart_with_huge_page_malloc()

import ml_collections  # noqa: E402
from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (default runs/<config name>).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_PROFILE_START = flags.DEFINE_integer(
    "profile_start_step", None, "Capture a profiler trace from this step (WORKDIR/profile)."
)
_PROFILE_STEPS = flags.DEFINE_integer("profile_num_steps", None, "Steps to trace.")


def _default_workdir() -> str:
    """runs/<config file name>, from the parsed flag (so `--config=X.py` and `--config X.py` agree)."""
    path = flags.FLAGS["config"].config_filename.split(":")[0]  # "file.py:param" takes a parameter
    return os.path.join("runs", os.path.splitext(os.path.basename(path))[0])


def _config_problem(error: BaseException) -> str:
    """One line for an exception raised while reading --config and its --config.* overrides."""
    raw = str(error).replace("\\'", "'").replace("\\n", "\n")
    text = " ".join(line.strip() for line in raw.splitlines() if line.strip())
    if isinstance(error, AttributeError) and "has no attribute 'get_config'" in raw:
        return "the --config file defines no get_config() function"
    field = re.search(r"'([^']+)'", raw)
    overridden = {part for arg in sys.argv[1:] if arg.startswith("--config.")
                  for part in arg[len("--config."):].split("=", 1)[0].split(".")}
    # (a lookup failing inside get_config() itself is the file's, whatever the overrides name)
    in_file = any(frame.name == "get_config" for frame in traceback.extract_tb(error.__traceback__))
    if (isinstance(error, AttributeError | KeyError) and field and field.group(1) in overridden
            and not in_file):
        # an override naming a field the config lacks (not a lookup failing inside get_config())
        hint = re.search(r'Did you mean "([^"]+)"', raw)
        return (f"a --config.* override names a field the config does not have: {field.group(1)!r}"
                + (f" (did you mean {hint.group(1)!r}?)" if hint else ""))
    if isinstance(error, OSError):  # the file is missing or unreadable: the innermost reason
        return f"cannot load the --config file: {str(error).strip().splitlines()[-1].strip()}"
    if isinstance(error, SyntaxError):
        return f"the --config file does not parse: {error}"
    frames = [f for f in traceback.extract_tb(error.__traceback__)
              if "site-packages" not in f.filename and not f.filename.startswith("<")]
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"reading --config failed{where}: {type(error).__name__}: {text}"


def _define_config_flag() -> None:
    """--config, whose default file (and its --config.* overrides) ml_collections reads as the flag
    is defined: its errors get the same one-line treatment as those of a --config given."""
    try:
        config_flags.DEFINE_config_file(
            "config",
            os.path.join(_HERE, "configs", "default.py"),
            "Training config file (a get_config() Python file).",
            lock_config=False,
        )
    except Exception as e:  # noqa: BLE001
        print(f"error: {_config_problem(e)}", file=sys.stderr, flush=True)
        sys.exit(2)


_define_config_flag()


def _flag_problem(error: BaseException) -> str:
    """absl's message for a bad flag value; for a list of files that does not parse as a tuple
    (`--config.dataset.train_files=a.tsv,b.tsv`), the form that does, in place of ml_collections'
    advice to quote it as one path."""
    files = re.match(r"flag --config\.((?:\w+\.)*\w+_files)=(.*?): Error while parsing string", str(error))
    if files:
        field, value = files.groups()
        return (f"--config.{field}={value} is not a tuple of paths: give several files as a Python tuple, "
                f"e.g. --config.{field}=\"('a.tsv', 'b.tsv')\" (quoted for the shell), one file as its path")
    parsing = re.match(r"flag --config=(.*?): Error whilst parsing config file:", str(error))
    if parsing:  # a TypeError or ValueError of get_config(), its traceback in ml_collections' text
        return _config_file_problem(parsing.group(1).split(":")[0], str(error))
    return str(error)


def _config_file_problem(path: str, text: str) -> str:
    """One line from the traceback text ml_collections wraps a get_config() error in: the exception's
    last line, at the config file's innermost line in it (a preset's ConfigError raised inside the
    library is the file's call to the preset)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    last = re.sub(r"^(?:\w+\.)+(\w+):", r"\1:", lines[-1])  # transformer_jax.config.ConfigError: ...
    mine = [(name, line) for name, line in re.findall(r'File "([^"]+)", line (\d+)', text)
            if os.path.abspath(name) == os.path.abspath(path)]
    where = f" (at {mine[-1][0]}:{mine[-1][1]})" if mine else ""
    return f"reading --config failed{where}: {last}"


def _parse_flags(argv):
    """absl's flag parsing, with one 'error: ...' line and status 2 for a bad flag or value (absl
    alone prints 'FATAL Flags parsing error' and exits 1) and for the errors ml_collections
    raises from the config file and its overrides."""
    whole = [arg.split("=", 1)[0] for arg in argv[1:]
             if re.match(r"--config\.(model|optimizer|dataset|mesh)=", arg)]
    if whole:  # ml_collections replaced the section: the file's other fields went back to defaults
        section = whole[0][len("--config."):]
        print(f"error: {whole[0]}=... would replace the whole config.{section} section, the config "
              f"file's other {section} fields going back to their defaults (for the model, the paper's "
              f"6+6 layers); set the fields one at a time: --config.{section}.FIELD=VALUE",
              file=sys.stderr, flush=True)
        sys.exit(2)
    files = ([arg.split("=", 1)[1] for arg in argv[1:] if arg.startswith("--config=")]
             + [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--config" and i > 0])
    if len(files) > 1:  # the last one was read, silently, or absl named its overrides "defined twice"
        print(f"error: --config is given {len(files)} times ({', '.join(files)}): give one config file "
              f"and change its fields with --config.FIELD=VALUE", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        argv = flags.FLAGS(argv)
        config = flags.FLAGS.config
        if not isinstance(config, ml_collections.ConfigDict) and type(config).__module__ != "builtins":
            config.keys()  # a file that failed to load (ml_collections' stand-in) raises only when read
        if not isinstance(config, ml_collections.ConfigDict):  # (a FrozenConfigDict is one too)
            print(f"error: get_config() in {flags.FLAGS['config'].config_filename} returned "
                  f"{type(config).__name__}, not an ml_collections.ConfigDict (return "
                  f"ml_collections.ConfigDict({{...}}))", file=sys.stderr, flush=True)
            sys.exit(2)
        return argv
    except flags.Error as e:  # an unknown flag, or a value of the wrong type (--config.x=abc)
        foreign = _not_a_python_config(argv) if "Error whilst parsing config file" in str(e) else None
        problem = foreign or _flag_problem(e)
        hint = ("" if problem.startswith(("reading --config failed", "--config="))
                else " (--helpshort lists the flags)")
        print(f"error: {problem}{hint}", file=sys.stderr, flush=True)
        sys.exit(2)
    except Exception as e:  # noqa: BLE001 - anything from the user's config file: no traceback
        foreign = _not_a_python_config(argv) if isinstance(e, NameError | SyntaxError) else None
        print(f"error: {foreign or _config_problem(e)}", file=sys.stderr, flush=True)
        sys.exit(2)


def _not_a_python_config(argv) -> str | None:
    """For a --config file that failed to load and is no Python file (a MaxText-style YAML, a gin or
    JSON file, read as Python it failed with a NameError or SyntaxError): what a config is."""
    paths = [arg.split("=", 1)[1] for arg in argv if arg.startswith("--config=")]
    paths += [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--config"]
    path = paths[-1].split(":")[0] if paths else ""
    if not path or path.endswith(".py") or not os.path.isfile(path):
        return None
    return (f"--config={path} is not a Python file: a config here is a .py file whose get_config() returns "
            f"an ml_collections.ConfigDict (see configs/); YAML, gin and JSON configs are not read")


def main(argv):
    try:
        _main(argv)
    except KeyboardInterrupt:  # a Ctrl-C before training started, or a second one (the first saves)
        print("interrupted: stopped without saving; the run resumes from its latest checkpoint",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Leave at once: a checkpoint write in progress would go on in its threads while the
        # interpreter shuts down under them, each printing a traceback (~550 lines). What it
        # leaves (a partial step) the next run's start removes.
        os._exit(130)
    except BrokenPipeError:
        if not _stdout_reader_gone():  # another pipe or socket: an error like any other
            raise
        # The reader of stdout is gone (`train.py | head`): end as a process that SIGPIPE ends,
        # without a traceback, after flushing nothing more into the closed pipe. A checkpoint write
        # in flight is cut off as by a kill, which leaves the earlier checkpoints as they were.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os._exit(128 + signal.SIGPIPE)


def _stdout_reader_gone() -> bool:
    """Whether standard output is a pipe whose reading end has been closed (poll reports an error
    condition on the writing end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _main(argv):
    if len(argv) > 1:  # e.g. `train.py configs/tiny.py`: one line, as for every other bad flag
        print(f"error: unexpected arguments {argv[1:]} (a config file is given as --config=FILE; "
              "--helpshort lists the flags)", file=sys.stderr, flush=True)
        sys.exit(2)
    import jax
    from absl import logging

    from transformer_jax import parallel

    if not flags.FLAGS["verbosity"].present:  # library INFO logs (orbax writes many) only on request
        logging.set_verbosity(logging.WARNING)
    from transformer_jax.training import USER_ERRORS, train_and_evaluate
    from transformer_jax.training.checkpoint import interrupt

    if signal.getsignal(signal.SIGINT) is _remember_interrupt:  # (not where train.py is imported)
        signal.signal(signal.SIGINT, interrupt)
    if _INTERRUPTED_AT_START:
        raise KeyboardInterrupt
    try:
        parallel.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    except (*USER_ERRORS, RuntimeError) as e:  # e.g. JAX_NUM_PROCESSES=two, or no coordinator
        print(f"error: {e}", file=sys.stderr, flush=True)
        if jax.distributed.is_initialized():  # refused after joining (another --num_processes):
            os._exit(2)  # the interpreter's exit would wait for the other processes (~30 s)
        sys.exit(2)
    config = flags.FLAGS.config
    if _PROFILE_START.value is not None:
        config.profile_start_step = _PROFILE_START.value
    if _PROFILE_STEPS.value is not None:
        config.profile_num_steps = _PROFILE_STEPS.value
    workdir = _WORKDIR.value or _default_workdir()  # (train_and_evaluate expands a '~')
    try:
        final = train_and_evaluate(config, workdir)
    except USER_ERRORS as e:  # a problem with the config, the data or the workdir: no traceback
        print(f"error: {e}", file=sys.stderr, flush=True)
        if jax.process_count() > 1:
            sys.stdout.flush()
            parallel.stop_child_processes()
            os._exit(2)  # the other processes may be inside a collective: no orderly shutdown
        sys.exit(2)
    stopped_by = final.pop("stopped_by", None)
    if parallel.is_primary():
        print(
            ("stopped: " if stopped_by else "final: ")
            + ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in sorted(final.items())
            ),
            flush=True,
        )
    # Stopped by a signal (preemption, Ctrl-C) after saving: 128 + its number (SIGTERM 143, SIGINT
    # 130), as a process the signal ended would, so that `train.py && next-step`, a retry loop or a
    # batch job's restart policy sees an unfinished run; 0 only for a finished one.
    code = 128 + signal.Signals[stopped_by].value if stopped_by else 0
    parallel.leave_and_exit(code)  # multi-process: leave together, skip a teardown that can hang
    sys.exit(code)  # one process: with the interpreter's teardown


if __name__ == "__main__":
    app.run(main, flags_parser=_parse_flags)
