"""Benchmark-only: on PYTHONPATH, every Python process started below (vLLM's engine core, the
draft server) prints all its threads' stacks to stderr on SIGUSR1, so a run that stops making
progress says where (``e2e_p6.py``'s watchdog sends it); with ``K3_BENCH_SWITCH_INTERVAL_S`` set, the
process's GIL switch interval (``sys.setswitchinterval``, a diagnosis variant of ``e2e_p6.py``). Not part
of the product."""
import faulthandler
import os
import signal
import sys

faulthandler.register(signal.SIGUSR1, all_threads=True)
if os.environ.get("K3_BENCH_SWITCH_INTERVAL_S"):
    sys.setswitchinterval(float(os.environ["K3_BENCH_SWITCH_INTERVAL_S"]))
