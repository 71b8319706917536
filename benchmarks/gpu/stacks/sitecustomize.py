"""Benchmark-only: on PYTHONPATH, every Python process started below (vLLM's engine core, the
draft server) prints all its threads' stacks to stderr on SIGUSR1, so a run that stops making
progress says where (``e2e_p6.py``'s watchdog sends it). Not part of the product."""
import faulthandler
import signal

faulthandler.register(signal.SIGUSR1, all_threads=True)
