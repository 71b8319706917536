"""``k3-accel demo`` and the machinery the end-to-end tests share with it.

* :mod:`k3_accel.demo.server`: a draft-server child process (signal, restart).
* :mod:`k3_accel.demo.scenario` / :mod:`k3_accel.demo.child`: runs of vLLM
  engines over rounds of prompts in a fresh process, with faults and records.
* :mod:`k3_accel.demo.checkpoints`: the tiny checkpoints (random, or trained and distilled).
* :mod:`k3_accel.demo.main` / :mod:`k3_accel.demo.report`: the demo itself and its report.
"""
