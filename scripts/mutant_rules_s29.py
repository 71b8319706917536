"""Rule mutants of the twenty-ninth session, for the modules the earlier sets probed least: the
controller's acceptance estimate, the server-fits-target rules of the handshake, the reply codec,
DSpark's sequential stage, reconnecting to a stored prefix and the feature-capture files. Each names
the tests that must notice."""
from __future__ import annotations

from mutant import Mutant

A = "vllm/spec_decode/acceptance.py"
H = "transport/handshake.py"
R = "protocol/replies.py"
D = "server/engines/dflash/dspark_model.py"
RC = "server/reconnect.py"
CAP = "transport/capture.py"
RECONNECT = ("tests/test_server.py", "tests/test_server_rules.py", "tests/test_server_dflash.py",
             "tests/test_dflash_pool.py")
CAPTURE = ("tests/test_transport_capture.py",)
CONTROLLER = ("tests/test_controller.py",)
FIT = ("tests/test_transport_failures.py", "tests/test_transport_settings.py", "tests/test_vllm_v2_dspark.py",
       "tests/test_doctor_dspark.py")
PROTOCOL = ("tests/test_protocol.py", "tests/test_protocol_sampling.py")
DSPARK = ("tests/test_dspark_vllm_module.py",)     # the peer oracle: vLLM 0.33's own DSpark module
V33 = ".venv-vllm033"
S29_MUTANTS = (
    Mutant("s29-acceptance-untried-counted", "drafts after the first rejection were not tried", A,
           "        tried = np.minimum(a + 1, g)", "        tried = g", CONTROLLER),
    Mutant("s29-acceptance-reused-row-kept", "a request starts from the global rate, not a forgotten one's counts",
           A, "            self._counts[row] = 0.0\n", "", CONTROLLER),
    Mutant("s29-acceptance-request-unsmoothed", "a request's own rate is smoothed toward the global one", A,
           "            rates[known] = (counts[:, 1] + w * g) / (counts[:, 0] + w)",
           "            rates[known] = counts[:, 1] / np.maximum(counts[:, 0], 1)", CONTROLLER),
    Mutant("s29-acceptance-table-full", "any number of requests has a row of counts", A,
           "                if row >= self._counts.shape[0]:", "                if row > self._counts.shape[0]:",
           CONTROLLER),
    Mutant("s29-acceptance-accepted-past-given", "no more drafts are accepted than were verified", A,
           "        a = np.minimum(np.maximum(a, 0), g)", "        a = np.maximum(a, 0)", CONTROLLER),
    Mutant("s29-fit-hidden-size", "a server of another hidden size is refused", H,
           "    if needs.hidden_size and caps.hidden_size and needs.hidden_size != caps.hidden_size:",
           "    if False:", FIT),
    Mutant("s29-fit-aux-layers", "a server of other aux layer ids is refused", H,
           "    if needs.aux_layer_ids and tuple(caps.aux_layer_ids) != tuple(needs.aux_layer_ids):",
           "    if False:", FIT),
    Mutant("s29-fit-draft-facts", "a DSpark server must match the target's draft config", H,
           "            for key, value in want.items() if caps.draft.get(key) != value]",
           "            for key, value in want.items() if False]", FIT),
    Mutant("s29-fit-hidden-dtype", "a server that takes no rows of the target's dtype is refused", H,
           "    if dtype not in caps.hidden_dtypes:", "    if False:", FIT),
    Mutant("s29-fit-topk", "a target that needs top-k logits refuses a server without them", H,
           '    if needs.logits == "topk" and not caps.supports_topk:', "    if False:", FIT),
    Mutant("s29-fit-capacity-warning", "a target running more requests than the server admits is warned", H,
           "    if needs.max_requests and caps.max_requests and needs.max_requests > caps.max_requests:",
           "    if False:", FIT),
    Mutant("s29-reply-extra-frames", "a reply's frames match its header exactly", R,
           "    if len(frames) - 1 != len(head.tensors):", "    if len(frames) - 1 < len(head.tensors):",
           PROTOCOL),
    Mutant("s29-reply-dtype-untyped", "a reply tensor of an unknown dtype is a typed error", R,
           "        if dtype not in DTYPES:", "        if False:", PROTOCOL),
    Mutant("s29-dspark-logit-scale", "the base logits are scaled by logit_scale", D,
           "    if scale != 1.0:\n        base = base * scale", "    if False:\n        base = base * scale",
           DSPARK, V33),
    Mutant("s29-dspark-topk-bias-unscaled", "the top-k path scales the Markov bias too", D,
           "alpha=scale)", "alpha=1.0)", DSPARK, V33),
    Mutant("s29-dspark-topk-prev-draft-id", "the next step's previous token is the mapped target id", D,
           "        prev = to_target(fw, pick.view(-1))", "        prev = pick.view(-1)", DSPARK, V33),
    Mutant("s29-dspark-confidence-no-markov", "a confidence head reading [h | e] gets the Markov embedding", D,
           "    w1 = heads.markov_w1 if cfg.confidence_with_markov else None", "    w1 = None", DSPARK, V33),
    Mutant("s29-reconnect-first-match", "a reconnect forks the longest stored prefix, not the first that matches",
           RC, "        if length > best_len:", "        if best is None:", RECONNECT),
    Mutant("s29-reconnect-partial-hidden", "an engine that needs hidden rows reuses only a context covering every "
           "cached token", RC, "    if engine.caps.needs_hidden_states and length < wanted:",
           "    if engine.caps.needs_hidden_states and length == 0:", RECONNECT),
    Mutant("s29-reconnect-prefix-overcounted", "the common prefix ends at the first differing token", RC,
           "    return int(diff[0]) if diff.size else n", "    return int(diff[0]) + 1 if diff.size else n", RECONNECT),
    Mutant("s29-reconnect-vocab-unchecked", "cached tokens outside the vocabulary are refused", RC,
           "    bad = int(outside_vocab(tokens, engine.caps.vocab_size).sum())", "    bad = 0", RECONNECT),
    Mutant("s29-capture-long-stem-cut", "long request ids keep distinct stems (a digest, not a cut)", CAP,
           '    return f"{stem[:80]}~{digest}"', "    return stem[:_MAX_STEM]", CAPTURE),
    Mutant("s29-capture-first-comma", "the first record of an index has no comma before it", CAP,
           '        text = (b",\\n" if self.count else b"") + json.dumps(record).encode("utf-8") + TAIL',
           '        text = b",\\n" + json.dumps(record).encode("utf-8") + TAIL', CAPTURE),
    Mutant("s29-capture-first-position", "a record names the first position of its rows", CAP,
           "        first = int(job.positions[0]) if job.positions.numel() else -1",
           "        first = int(job.positions[-1]) if job.positions.numel() else -1", CAPTURE),
    Mutant("s29-plane-read-own-dtype", "a device-plane read judges its rows' top bits by the ring's own dtype",
           "server/device_plane.py", "        return nonfinite_top_bits(self.bits.numpy(), self.hidden.dtype)",
           "        return nonfinite_top_bits(self.bits.numpy(), torch.float32)", ("tests/test_store.py",)),
)
