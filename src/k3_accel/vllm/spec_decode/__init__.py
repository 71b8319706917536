"""Remote drafting inside vLLM: one runner-independent core under thin V1 and V2 adapters.

* ``methods``  which speculative methods a draft server serves (the gating rule).
* ``session``  the target's facts, the TP-rank-0 client and the broadcast to every rank.
* ``core``     the skip rule, the known-request book, failure logging, one step.
* ``rows``     a step's rows in the target batch -> the transport's ``StepInput``.
* ``hooks``    where vLLM is patched (V1 runner, V2 ``init_speculator``).
* ``v1``, ``v1_ngram``, ``v1_tokens``  the V1 runner's drafters (vLLM imported).
* ``v2``       the V2 runner's speculator (vLLM's ``BaseSpeculator`` imported on first use).
"""
