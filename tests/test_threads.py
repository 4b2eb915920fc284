"""The thread policy (genkit.threads, issue 32 item 4): physical cores available to the process,
never more than the CPUs it has, fewer on a busy machine (with a warning)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from genkit.errors import ConfigError
from genkit.threads import (
    available_cpus,
    busy,
    cgroup_cpu_limit,
    check_threads,
    cpu_budget,
    default_threads,
    physical_cores,
    runnable_elsewhere,
)


def _topology(root, cpus):
    """A /sys/devices/system/cpu tree: ``cpus`` maps cpu number -> (package, core)."""
    for cpu, (package, core) in cpus.items():
        topo = root / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "core_id").write_text(f"{core}\n")
        (topo / "physical_package_id").write_text(f"{package}\n")
    return str(root)


def test_hyperthreads_of_one_core_count_once(tmp_path):
    # 2 packages x 2 cores x 2 hyper-threads
    cpus = {i: (i // 4, (i // 2) % 2) for i in range(8)}
    root = _topology(tmp_path, cpus)
    assert physical_cores(list(range(8)), sys_cpu=root) == 4
    assert physical_cores([0, 1], sys_cpu=root) == 1  # two siblings of one core
    assert physical_cores([0, 2, 4], sys_cpu=root) == 3
    assert physical_cores([0, 9], sys_cpu=root) == 2  # cpu9 has no topology: every CPU counts


def test_cgroup_quota(tmp_path):
    path = tmp_path / "cpu.max"
    path.write_text("150000 100000\n")
    assert cgroup_cpu_limit(str(path)) == 2
    path.write_text("max 100000\n")
    assert cgroup_cpu_limit(str(path)) is None
    assert cgroup_cpu_limit(str(tmp_path / "absent")) is None


def test_the_default_is_at_most_the_cpus_available_and_fits_the_load(caplog, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    budget = cpu_budget()
    assert budget <= len(available_cpus()) == len(os.sched_getaffinity(0))
    idle = default_threads(load=0.0)
    assert 1 <= idle == min(physical_cores(), budget)
    with caplog.at_level(logging.WARNING, logger="genkit.threads"):
        busy = default_threads(load=float(budget) + 4)
    assert busy == idle  # the same count whatever the load: seeded runs stay reproducible
    if idle > 1:
        assert "the machine is busy" in caplog.text and "--threads 1" in caplog.text
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads(load=0.0) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "100000")
    assert default_threads(load=0.0) == budget  # never more than available


def test_the_load_this_process_made_itself_does_not_count_as_busy():
    """The 1-minute load average counts this process's own last minute (a benchmark's reference
    run, say): other work is at most what other processes have runnable now."""
    budget = cpu_budget()
    assert busy(budget, load=float(budget) + 3, elsewhere=0) is None
    why = busy(1, load=float(budget) + 3, elsewhere=budget)
    assert why == f"1-minute load average {budget + 3:.1f}, {budget} runnable elsewhere now + 1 thread(s) > {budget} CPUs"
    assert busy(1, load=0.0, elsewhere=budget + 5) is None  # a moment's crowd on an idle minute
    assert busy(budget, load=float(budget) + 3) is not None  # no count of runnable threads: the load decides


@pytest.mark.parametrize(("readings", "expected", "taken"), [
    ([2, 1, 3], 1, 3),        # the fewest of three: a thread waking for a moment is in one reading only
    ([1, 0, 5], 0, 2),        # a reading of 0 ends it
    ([0, 4, 4], 0, 1),
    ([3, None, 0], None, 2),  # a system that stops saying: None, not a count of the readings before
    ([None], None, 1),
])
def test_runnable_elsewhere_takes_the_fewest_of_its_readings(readings, expected, taken):
    left = list(readings)
    assert runnable_elsewhere(reads=3, pause=0.0, read=lambda: left.pop(0)) == expected
    assert len(readings) - len(left) == taken


def test_runnable_elsewhere_leaves_out_this_processs_threads():
    import threading

    if runnable_elsewhere() is None:
        pytest.skip("this system has no /proc/loadavg")
    before = min(runnable_elsewhere() for _ in range(20))
    stop = threading.Event()
    spinners = [threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)]) for _ in range(3)]
    for t in spinners:
        t.start()
    try:
        during = min(runnable_elsewhere() for _ in range(20))
    finally:
        stop.set()
        for t in spinners:
            t.join()
    assert during <= before + 1  # three more runnable threads here, none of them counted


@pytest.mark.parametrize("bad", [0, -1, 100000, 1.5, True, "2"])
def test_a_bad_count_names_the_accepted_range(bad):
    with pytest.raises(ConfigError, match=rf"`threads`={bad!r} is not valid; accepted: an integer from 1 to "
                                          rf"{cpu_budget()} \(the CPUs available to this process\)"):
        check_threads(bad)
    assert check_threads(1) == 1 and check_threads(None) is None


def test_apply_threads_sets_torch_and_the_openmp_environment():
    """In a fresh process (torch not yet imported): intra-op threads as asked, one inter-op thread,
    OMP_NUM_THREADS set before torch loads."""
    code = ("import os, sys; from genkit.threads import apply_threads; n = apply_threads(1); import torch; "
            "print(n, torch.get_num_threads(), torch.get_num_interop_threads(), os.environ['OMP_NUM_THREADS'])")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["1", "1", "1", "1"], out.stderr


def test_releasing_the_openmp_workers_lets_this_threads_pool_go():
    """After parallel work at 2 threads, the OpenMP runtime (torch's, already loaded) keeps a worker
    beside this thread; release_openmp_workers() lets it go (the process runs one thread fewer) and
    the next parallel work makes it again (continuous batching calls it before its thread starts).
    The released worker leaves /proc/self/task when the scheduler next runs it (the runtime does not
    join it): on a loaded machine that is later than the call's return, so the count is awaited
    (bounded: 10 s)."""
    code = ("import os, time, torch; from genkit.threads import release_openmp_workers; torch.set_num_threads(2); "
            "tasks = lambda: len(os.listdir('/proc/self/task')); x = torch.randn(1 << 21); x.exp(); "
            "before = tasks(); ok = release_openmp_workers(); end = time.monotonic() + 10\n"
            "while tasks() >= before and time.monotonic() < end: time.sleep(0.01)\n"
            "after = tasks(); x.exp(); "
            "print('OpenMP' in torch.__config__.parallel_info(), ok, before - after, tasks() - after)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "True", "1", "1"], (out.stdout, out.stderr)
