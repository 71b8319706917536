"""Rule mutants of the modules this wave added (the device plane, the split protocol, sampled DSpark,
the DSpark demo) and of the test builders in ``k3_accel.testing``: one per module. Written from each
module's rule, not from its tests."""
from __future__ import annotations

from mutant import Mutant

D = "server/engines/dflash/"
V33 = ".venv-vllm033"

WAVE_MUTANTS = (
    # ------------------------------------------------------------- the wire
    Mutant("frame-size-unchecked", "a frame whose bytes disagree with its header is refused (FRAME_MISMATCH)",
           "protocol/base.py", "    nbytes = math.prod(shape) * dtype.itemsize\n    if buf.nbytes != nbytes:",
           "    nbytes = math.prod(shape) * dtype.itemsize\n    if False:", ("tests/test_protocol.py",)),
    Mutant("reply-frames-uncounted", "a reply whose frames do not match its header is refused",
           "protocol/replies.py", "    if len(frames) - 1 != len(head.tensors):", "    if False:",
           ("tests/test_protocol.py", "tests/test_transport_client.py")),
    # ------------------------------------------------------------- the device plane
    Mutant("identity-ignores-hostname", "two containers on one kernel are two hosts (no shared CUDA memory)",
           "ipc.py", 'f"{boot}|{socket.gethostname()}"', 'f"{boot}"', ("tests/test_ipc_rules.py",)),
    Mutant("plane-other-host-asked", "a server on another host is never asked to open a ring",
           "transport/device_plane.py",
           '        if offer.host != ipc.host_identity():\n            return "the server runs on another host"',
           '        if False:\n            return "the server runs on another host"', ("tests/test_device_plane.py",)),
    Mutant("plane-rows-without-ring", "device rows on a connection without a ring are refused (BAD_REQUEST)",
           "server/device_plane.py", "        if imp is None or imp.conn != conn:",
           "        if imp is not None and imp.conn != conn:", ("tests/test_device_plane.py",)),
    # ------------------------------------------------------------- sampled DSpark, its demo
    Mutant("gumbel-unsalted", "draft draws use vLLM's salted position (disjoint from the target's draws)",
           D + "gumbel.py", "SALT = 1 << 30", "SALT = 0", ("tests/test_dspark_vllm_module.py",), V33),
    Mutant("dspark-demo-always-ok", "the DSpark demo fails when a step got no drafts", "demo/dspark.py",
           '    return 0 if result["steps_without_drafts"] == 0 else 1', "    return 0",
           ("tests/test_e2e_demo.py", "tests/test_demo_rules.py")),
    # ------------------------------------------------------------- test builders (k3_accel.testing)
    Mutant("tiny-draft-layers-misnamed", "a tiny DFlash draft lists its target layers where vLLM reads them",
           "testing/tiny.py", '"target_layer_ids": list(target_layer_ids)', '"layers": list(target_layer_ids)',
           ("tests/test_dflash_engine.py", "tests/test_distill.py")),
    Mutant("tiny-dspark-markov-unscaled", "a tiny DSpark draft's Markov head has the asked-for scale",
           "testing/tiny_dspark.py", "torch.randn(vocab, markov_rank, generator=gen) * markov_std",
           "torch.zeros(vocab, markov_rank)", ("tests/test_dspark_engine.py", "tests/test_dspark_rules.py")),
    Mutant("tiny-lm-untrained", "the tiny LM target is trained on its text (it continues it)", "testing/tiny_lm.py",
           "        model, losses = _train(out, text, steps, batch, window, lr, seed)",
           "        model, losses = _train(out, text, 0, batch, window, lr, seed)", ("tests/test_distill.py",)),
    Mutant("target-data-anchor-in-prompt", "distillation blocks start at generated tokens, never in the prompt",
           "testing/target_data.py", "        return torch.arange(self.prompt_len, self.tokens.shape[1] - k)",
           "        return torch.arange(0, self.tokens.shape[1] - k)", ("tests/test_distill.py",)),
    Mutant("draft-model-norm-eps-lost", "the trainable draft normalises as the checkpoint says (rms eps)",
           "testing/draft_model.py",
           "    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight",
           "    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1.0) * weight",
           ("tests/test_distill.py",)),
    Mutant("distill-no-update", "distillation trains (the draft beats the random one)", "testing/distill.py",
           "        loss.backward()\n        opt.step()", "        loss.backward()", ("tests/test_distill.py",)),
    Mutant("distill-dspark-markov-dropped", "a distilled DSpark draft keeps the Markov head it trained",
           "testing/distill_dspark.py",
           '    tensors["markov_head.markov_w1.weight"], tensors["markov_head.markov_w2.weight"] = w1.detach(), w2.detach()',
           "    pass", ("tests/test_e2e_demo.py",)),
    # ------------------------------------------------------------- tenth session
    Mutant("coalesce-release-unflushed", "rows still waiting are stored before their blocks can go to another request",
           D + "engine.py", "        self.flush()                                   # its blocks may be someone else's next",
           "        pass", ("tests/test_dflash_coalesce.py",)),
    Mutant("coalesce-rewind-unflushed", "rows a rewind replaces are stored before their successors",
           D + "engine.py", "            self.flush()                 # a rewind frees or rewrites rows that may still be waiting",
           "            pass", ("tests/test_dflash_coalesce.py",)),
    Mutant("coalesce-propose-unflushed", "a propose reads every row ingested before it", D + "engine.py",
           "            return self._empty(r, k, batch)\n        self.flush()\n",
           "            return self._empty(r, k, batch)\n", ("tests/test_dflash_coalesce.py",)),
    Mutant("coalesce-fork-unflushed", "a fork copies rows that are stored, not still waiting", D + "engine.py",
           "        self.flush()                                   # the copy of a partial block reads its rows",
           "        pass", ("tests/test_dflash_coalesce.py",)),
    Mutant("coalesce-device-rows-wait", "rows read over the device plane are projected before their ring slot is reused",
           D + "engine.py", '''        if batch.hidden is None or batch.hidden.device.type != "cpu" or \\''',
           '''        if batch.hidden is None or \\''',
           ("tests/test_dflash_coalesce.py::test_rows_read_over_the_device_plane_are_projected_before_their_slot_is_reused",)),
    Mutant("argmax-sum-unrounded", "a fused sum is rounded as the stored one would be (DSpark drafts = vLLM's)",
           D + "ops_triton.py", "        x = (x.to(tl.float32) + y.to(tl.float32)).to(x_ptr.dtype.element_ty)",
           "        x = x.to(tl.float32) + y.to(tl.float32)", ("tests/test_dflash_precision.py",)),
    Mutant("ngram-batch-rows-shared", "each request of an n-gram batch ingests its own rows",
           "server/engines/ngram.py", "            at += count\n", "", ("tests/test_ngram.py",)),
)
