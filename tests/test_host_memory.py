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
