"""transformer_jax.host_memory: a script starts itself again with glibc's huge pages for malloc."""

import os
import subprocess
import sys

import pytest

from transformer_jax import host_memory

_PROBE = ("from transformer_jax import host_memory; host_memory.restart_with_huge_page_malloc(); "
          "import os; print(repr(os.environ.get('GLIBC_TUNABLES')), os.getpid())")


def _probe(**env):
    base = {k: v for k, v in os.environ.items() if k != host_memory.ENV}
    proc = subprocess.Popen([sys.executable, "-c", _PROBE], env={**base, **env}, stdout=subprocess.PIPE,
                            text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    value, pid = out.split()
    return value, int(pid), proc.pid


@pytest.mark.skipif(host_memory.huge_page_malloc_problem() is not None,
                    reason=f"no huge pages for malloc here: {host_memory.huge_page_malloc_problem()}")
def test_a_script_restarts_itself_with_the_tunable_in_the_same_process():
    value, pid, launched = _probe()
    assert value == repr(host_memory.TUNABLE) and pid == launched  # exec: the same process, restarted
    # GLIBC_TUNABLES set by the user, even empty, is theirs: no restart.
    assert _probe(GLIBC_TUNABLES="")[0] == "''"
    assert _probe(GLIBC_TUNABLES="glibc.malloc.check=0")[0] == "'glibc.malloc.check=0'"


def test_where_it_cannot_the_process_is_left_alone(monkeypatch, tmp_path):
    monkeypatch.delenv(host_memory.ENV, raising=False)
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("glibc", "2.31"))
    assert "glibc 2.35 or later (this is glibc 2.31)" in host_memory.huge_page_malloc_problem()
    assert host_memory.restart_environment() is None
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("", ""))
    assert "an unknown C library" in host_memory.huge_page_malloc_problem()
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("glibc", "2.36"))
    never = tmp_path / "enabled"
    never.write_text("always madvise [never]\n")
    monkeypatch.setattr(host_memory, "_THP_ENABLED", str(never))
    assert host_memory.huge_page_malloc_problem() == "transparent huge pages are off ([never])"
    monkeypatch.setattr(host_memory, "_THP_ENABLED", str(tmp_path / "missing"))
    assert "is missing" in host_memory.huge_page_malloc_problem()
    never.write_text("always [madvise] never\n")
    monkeypatch.setattr(host_memory, "_THP_ENABLED", str(never))
    monkeypatch.setattr(host_memory.sys, "platform", "linux")
    assert host_memory.huge_page_malloc_problem() is None
    assert host_memory.restart_environment()[host_memory.ENV] == host_memory.TUNABLE
    monkeypatch.setenv(host_memory.ENV, "")
    assert host_memory.restart_environment() is None
    monkeypatch.setattr(host_memory.sys, "platform", "darwin")
    assert host_memory.huge_page_malloc_problem() == "needs Linux (this is darwin)"


@pytest.mark.skipif(host_memory.huge_page_malloc_problem() is not None,
                    reason=f"no huge pages for malloc here: {host_memory.huge_page_malloc_problem()}")
@pytest.mark.parametrize("how", ["stdin", "notebook kernel"])
def test_a_program_a_restart_would_not_run_again_is_left_alone(how):
    """A script read from standard input (the restarted interpreter would find it read already
    and exit 0 having done nothing) and a notebook kernel (its cells and state would be lost) go
    on as they are, without the tunable."""
    base = {k: v for k, v in os.environ.items() if k != host_memory.ENV}
    script = _PROBE + "; print('continued')"
    if how == "stdin":
        command, stdin = [sys.executable, "-"], script
    else:
        kernel = "import sys, types; sys.modules['ipykernel'] = types.ModuleType('ipykernel'); "
        command, stdin = [sys.executable, "-c", kernel + script], None
    proc = subprocess.run(command, input=stdin, env=base, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    value, _pid, continued = proc.stdout.split()
    assert value == "None" and continued == "continued"


@pytest.mark.skipif(host_memory.huge_page_malloc_problem() is not None,
                    reason=f"no huge pages for malloc here: {host_memory.huge_page_malloc_problem()}")
def test_a_process_with_huge_pages_turned_off_is_told_so():
    """prctl(PR_SET_THP_DISABLE), which some launchers and sandboxes set (children inherit it),
    is named as the reason, by the restart's check and by the parameters' placement (which said
    the kernel had to be Linux 6.1 or later)."""
    from transformer_jax.decoding import huge_pages

    code = ("import ctypes; assert ctypes.CDLL(None).prctl(41, 1, 0, 0, 0) == 0; "  # PR_SET_THP_DISABLE
            "import jax.numpy as jnp; from transformer_jax import host_memory; "
            "from transformer_jax.decoding import huge_pages; "
            "print(host_memory.huge_page_malloc_problem()); "
            "print(huge_pages.place_on_huge_pages(jnp.ones(3 << 20, jnp.float32)).reason)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    problem, placement = proc.stdout.strip().splitlines()[-2:]
    off = "transparent huge pages are off for this process (prctl PR_SET_THP_DISABLE)"
    assert problem == off
    plain = huge_pages._collapse_refused_because().startswith("it needs")  # no other reason here
    if huge_pages.huge_page_size() is not None and plain:
        assert placement == f"madvise(MADV_COLLAPSE) refused everywhere (EINVAL): {off}"


@pytest.mark.skipif(host_memory.huge_page_malloc_problem() is not None,
                    reason=f"no huge pages for malloc here: {host_memory.huge_page_malloc_problem()}")
def test_train_py_restarts_before_it_imports_jax():
    """train.py restarts itself before reading its --config (whose file imports jax): restarting
    after it imported jax, transformer_jax and the config a second time, ~2 s of each start."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = {k: v for k, v in os.environ.items() if k != host_memory.ENV}
    # -X importtime lists each module a process imports, on stderr; --process_id=1 alone is refused
    # after the imports, before any work
    proc = subprocess.run([sys.executable, "-X", "importtime", os.path.join(repo, "train.py"),
                           "--config=" + os.path.join(repo, "configs", "tiny.py"), "--process_id=1"],
                          env={**base, "PYTHONPATH": repo}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    imports = [line.split("|")[-1].strip() for line in proc.stderr.splitlines()
               if line.startswith("import time:")]
    # two interpreters started (each imports encodings), the first before it imported jax
    assert (imports.count("encodings"), imports.count("jax"), imports.count("transformer_jax")) == (2, 1, 1)
    assert "error: several processes need --coordinator_address" in proc.stderr
