"""How many CPU threads genkit runs a model with: the one place that decides it (docs/threads.md).

The default is the number of *physical* cores *available to this process*: the CPUs in its
affinity mask (``os.sched_getaffinity``), counted once per core (hyper-threads share one), capped by
a cgroup CPU quota (``cpu.max``) when the process has one. ``OMP_NUM_THREADS``, when set, is the
default instead. A thread count is never more than the CPUs available, and torch's inter-op pool is
kept to one thread, so the process never asks for more threads than it has CPUs.

When the threads and the 1-minute load average together ask for more than the CPUs available,
a warning says so and suggests ``--threads 1`` (torch's threads spin while they wait; on a busy
2-core machine two threads ran 20-40x slower than one). The default is not lowered from the load:
a seeded run must give the same tokens whatever else runs (sums depend on the thread count), and
the average lags by a minute.

No torch import at module import time: the CLI calls :func:`apply_threads` before torch loads.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import time
from collections.abc import Callable

from .errors import ConfigError

logger = logging.getLogger("genkit.threads")
LOADAVG = "/proc/loadavg"  # the system's load figures, runnable threads among them (Linux)

_SYS_CPU = "/sys/devices/system/cpu"


def available_cpus() -> list[int]:
    """The logical CPUs this process may run on (its affinity mask)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as fh:
            return fh.read().strip()
    except (OSError, ValueError):
        return None


def physical_cores(cpus: list[int] | None = None, sys_cpu: str = _SYS_CPU) -> int:
    """How many physical cores the logical CPUs ``cpus`` (default: :func:`available_cpus`) are on:
    CPUs with the same (package, core) id in ``/sys/devices/system/cpu/cpuN/topology`` count once.
    Where the topology cannot be read every CPU counts as a core."""
    cpus = available_cpus() if cpus is None else cpus
    cores = set()
    for cpu in cpus:
        topo = os.path.join(sys_cpu, f"cpu{cpu}", "topology")
        core, package = _read(os.path.join(topo, "core_id")), _read(os.path.join(topo, "physical_package_id"))
        if core is None:
            return max(1, len(cpus))
        cores.add((package, core))
    return max(1, len(cores))


def cgroup_cpu_limit(path: str = "/sys/fs/cgroup/cpu.max") -> int | None:
    """The CPUs a cgroup v2 quota (``cpu.max``: ``quota period``) allows, rounded up; None when
    there is no quota."""
    text = _read(path)
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max" or not period:
        return None
    try:
        return max(1, -(-int(quota) // int(period)))
    except (ValueError, ZeroDivisionError):
        return None


def cpu_budget() -> int:
    """The most threads this process can run at once: its CPUs, capped by its cgroup quota."""
    cpus = len(available_cpus())
    quota = cgroup_cpu_limit()
    return max(1, min(cpus, quota) if quota else cpus)


def load_average() -> float | None:
    """The 1-minute load average (None where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _env_threads() -> int | None:
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) > 0 else None


def default_threads(load: float | None = None) -> int:
    """The thread count genkit uses when none is asked for (see the module doc): ``OMP_NUM_THREADS``
    when set, else the physical cores available; a warning when the machine is busy (``load``: the
    1-minute load average; read from the system when None)."""
    budget = cpu_budget()
    env = _env_threads()
    if env is not None:
        return min(env, budget)
    threads = min(physical_cores(), budget)
    # never lowered from the load: a seeded run must give the same tokens whatever else runs
    # (float sums depend on the thread count), and the 1-minute average lags; a warning instead
    warn_if_busy(threads, load)
    return threads


def runnable_elsewhere(reads: int = 3, pause: float = 0.005,
                       read: Callable[[], int | None] | None = None) -> int | None:
    """How many threads of other processes are runnable now: the system's count of runnable
    threads (``/proc/loadavg``) less this process's own (``/proc/self/task/*/stat`` in state R),
    the fewest of up to ``reads`` readings ``pause`` seconds apart, stopping at a reading of 0 (one
    reading is an instant: on a 2-CPU machine with both busy, a system thread waking for a moment
    was in one reading of 8, and made a first run skip its kernel probe); None where the system does
    not say. ``read`` takes one reading (default: the system's, as above)."""
    read = _runnable_elsewhere_once if read is None else read
    fewest: int | None = None
    for i in range(reads):
        if i:
            time.sleep(pause)
        now = read()
        if now is None:
            return None
        fewest = now if fewest is None else min(fewest, now)
        if fewest == 0:
            break
    return fewest


def _runnable_elsewhere_once() -> int | None:
    try:
        with open(LOADAVG, encoding="ascii") as fh:
            running = int(fh.read().split()[3].split("/")[0])
        own = 0
        for task in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{task}/stat", encoding="ascii", errors="replace") as fh:
                    own += fh.read().rsplit(")", 1)[1].split()[0] == "R"
            except OSError:  # the thread ended meanwhile
                continue
        return max(0, running - own)
    except (OSError, ValueError, IndexError):
        return None


def busy(threads: int, load: float | None = None, elsewhere: int | None = None) -> str | None:
    """Why the machine is busy for ``threads`` more threads: other work plus ``threads`` is above
    the CPUs available (half a CPU of slack); None when it is not (or the system has no load
    average). Other work is the 1-minute load average (``load``; read from the system when None),
    but no more than the threads of other processes runnable now (``elsewhere``; read from the
    system when both are None): the load average counts this process's own work of the last
    minute, which competes with nobody."""
    budget = cpu_budget()
    if load is None:
        load = load_average()
        elsewhere = runnable_elsewhere() if elsewhere is None else elsewhere
    if load is None:
        return None
    others = load if elsewhere is None else min(load, float(elsewhere))
    if others + threads > budget + 0.5:
        now = "" if elsewhere is None else f", {elsewhere} runnable elsewhere now"
        return f"1-minute load average {load:.1f}{now} + {threads} thread(s) > {budget} CPUs"
    return None


def warn_if_busy(threads: int, load: float | None = None) -> None:
    """A warning when more than one thread is asked for and the machine is :func:`busy`."""
    why = busy(threads, load) if threads > 1 else None
    if why:
        logger.warning("the machine is busy (%s): %d threads will compete with other processes; pass --threads 1 "
                       "(or threads=1) if it runs slowly", why, threads)


def check_threads(threads: int | None) -> int | None:
    """``threads`` when it is a count between 1 and the CPUs available; a ConfigError otherwise."""
    if threads is None:
        return None
    budget = cpu_budget()
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= budget:
        raise ConfigError(f"`threads`={threads!r} is not valid; accepted: an integer from 1 to {budget} "
                          f"(the CPUs available to this process), or None for the default")
    return threads


def apply_threads(threads: int | None = None) -> int:
    """Run torch with ``threads`` intra-op threads (None: :func:`default_threads`) and one inter-op
    thread; returns the count. Called before torch is imported, it also sets ``OMP_NUM_THREADS`` /
    ``MKL_NUM_THREADS`` (when unset) so the OpenMP pool is created at that size."""
    n = check_threads(threads) or default_threads()
    if threads is not None:  # the default warned already
        warn_if_busy(n)
    if "torch" not in sys.modules:
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            if threads is not None or var not in os.environ:
                os.environ[var] = str(n)
    import torch

    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # the inter-op pool is fixed once parallel work has started
        logger.debug("torch's inter-op thread pool is already started; left at %d", torch.get_num_interop_threads())
    logger.info("running with %d thread(s)", n)
    return n


# OpenMP runtimes torch may run on, by the name the loader knows them: GNU (torch's Linux wheels,
# and genkit's C kernels), LLVM, Intel
OPENMP_RUNTIMES = ("libgomp.so.1", "libomp.so", "libomp.so.5", "libiomp5.so")


def release_openmp_workers() -> bool:
    """Let the calling thread's idle OpenMP workers go (``omp_pause_resource_all``, in the runtime
    already loaded; nothing is loaded), for a thread that is about to wait while another computes.

    GNU OpenMP keeps a pool of workers for every thread that has run parallel work. Once it
    manages more threads than there are CPUs -- the loading thread's idle pool beside the pool of
    continuous batching's own thread, at the full thread count -- its workers stop spinning
    between parallel regions and sleep, and every region then wakes them through the kernel: one
    SmolLM2 float32 request's continuous-batching step took 20.0 ms instead of 9.3 (the same step on
    the loading thread: 9.4; 2 threads on 2 CPUs). The released pool is made again when this thread
    next computes in parallel.
    Returns whether a runtime was found and released it."""
    load = getattr(os, "RTLD_NOLOAD", None)
    if load is None:  # not a POSIX loader: nothing to look up without loading
        return False
    for name in OPENMP_RUNTIMES:
        try:
            runtime = ctypes.CDLL(name, mode=load)
            pause = runtime.omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        rc = pause(1)  # omp_pause_soft
        logger.debug("released this thread's OpenMP workers (%s): rc %d", name, rc)
        return rc == 0
    return False
