"""``k3-accel doctor`` against real draft servers: the verdict and the exit status a person acts on."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers.server import ServerProcess, src_env
from helpers.steps import wait_until
from helpers.wire import Wire
from k3_accel.protocol import Bye, Stats
from k3_accel.testing.tiny import write_tiny_dflash, write_tiny_target


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor")
    target = write_tiny_target(root / "target")
    return target, write_tiny_dflash(root / "draft", target)


@pytest.fixture(scope="module")
def ngram():
    srv = ServerProcess("--engine", "ngram", "--max-requests", "64", "--lease-s", "600")   # only bye frees
    yield srv
    srv.stop()


def doctor(address: str, target, spec: dict, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "k3_accel.cli", "doctor", address, "--model", str(target),
           "--speculative-config", json.dumps(spec), "--timeout-ms", "5000", *extra]
    return subprocess.run(cmd, env=src_env(), capture_output=True, text=True, timeout=300)


def test_a_fitting_server_gets_a_yes_and_exit_0(ngram, checkpoints):
    target, _ = checkpoints
    run = doctor(ngram.address, target, {"method": "ngram", "num_speculative_tokens": 4}, "--max-num-seqs", "16")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "VERDICT: vLLM would draft with this server." in run.stdout
    assert "propose round trip over 20 steps" in run.stdout and "FAIL" not in run.stdout


def test_capacity_below_max_num_seqs_is_a_note_not_a_failure(ngram, checkpoints):
    target, draft = checkpoints
    run = doctor(ngram.address, target, {"method": "dflash", "model": str(draft), "num_speculative_tokens": 4},
                 "--max-num-seqs", "1024")
    assert run.returncode == 0, run.stdout
    assert "capacity: target runs up to 1024 requests (max_num_seqs), the server admits 64 per client" in run.stdout


def test_other_ngram_sizes_are_a_note_naming_the_server_flags(ngram, checkpoints):
    target, _ = checkpoints
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 5}
    run = doctor(ngram.address, target, spec, "--max-num-seqs", "16")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "the server matches grams of 1..3 tokens, the target's prompt_lookup_min/max are 5..5" in run.stdout
    assert "--ngram-min 5 --ngram-max 5" in run.stdout


def test_ngram_sizes_left_out_are_vllms_defaults(ngram, checkpoints):
    """vLLM 0.33 sets prompt_lookup_min/max to 5/5 when neither is given and one to the other when
    only one is: the doctor compares those sizes (a note against a 1..3 server), and refuses a
    config vLLM refuses (min > max)."""
    target, _ = checkpoints
    run = doctor(ngram.address, target, {"method": "ngram", "num_speculative_tokens": 4}, "--max-num-seqs", "16")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "the target's prompt_lookup_min/max are 5..5" in run.stdout
    run = doctor(ngram.address, target, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 2},
                 "--max-num-seqs", "16")
    assert run.returncode == 0 and "the target's prompt_lookup_min/max are 2..2" in run.stdout, run.stdout
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 4, "prompt_lookup_max": 2}
    run = doctor(ngram.address, target, spec)
    assert run.returncode == 2 and "prompt_lookup_min=4 must be <= prompt_lookup_max=2" in run.stdout, run.stdout


def test_k_beyond_the_server_is_a_failure_naming_both_values(ngram, checkpoints):
    target, _ = checkpoints
    run = doctor(ngram.address, target, {"method": "ngram", "num_speculative_tokens": 40})
    assert run.returncode == 1
    assert "K: target asks for 40, server allows 16" in run.stdout and "would NOT draft" in run.stdout


def test_a_method_drafted_locally_is_reported(ngram, checkpoints):
    target, draft = checkpoints
    run = doctor(ngram.address, target, {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3})
    assert run.returncode == 1 and "method 'eagle3' is drafted locally" in run.stdout


def test_a_dflash_draft_is_gated_under_the_name_vllm_gives_it(tmp_path, checkpoints):
    """vLLM 0.33 serves a dflash draft as DFlash{arch} (EAGLEConfig): Laguna's draft checkpoint says
    LagunaForCausalLM, vLLM runs DFlashLagunaForCausalLM, which the plugin leaves local; the doctor
    must say so too (it stops before any hello, so nobody need listen)."""
    from helpers.ports import free_port
    target, draft = checkpoints
    cfg = json.loads((draft / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "architectures": ["LagunaForCausalLM"]}))
    run = doctor(f"tcp://127.0.0.1:{free_port()}", target,
                 {"method": "dflash", "model": str(tmp_path), "num_speculative_tokens": 4})
    assert run.returncode == 1, run.stdout + run.stderr
    assert "draft architecture DFlashLagunaForCausalLM is not plain DFlash" in run.stdout


def test_nobody_listening_is_a_failure_with_advice(checkpoints):
    from helpers.ports import free_port
    target, _ = checkpoints
    run = doctor(f"tcp://127.0.0.1:{free_port()}", target, {"method": "ngram", "num_speculative_tokens": 4})
    assert run.returncode == 1 and "no answer from" in run.stdout and "is k3-draft-server running" in run.stdout


def test_curve_keys_that_cannot_serve_exit_2_naming_the_flag(checkpoints, tmp_path):
    """A missing key file, a client certificate without its secret half, or one key of the pair
    alone: a usage error naming the flag (exit 2), not a traceback."""
    import zmq.auth
    from helpers.ports import free_port
    target, _ = checkpoints
    public, _secret = zmq.auth.create_certificates(str(tmp_path), "client")
    address, spec = f"tcp://127.0.0.1:{free_port()}", {"method": "ngram", "num_speculative_tokens": 4}
    missing = str(tmp_path / "nowhere.key")
    for flags, needle in ((("--curve-server-key", missing, "--curve-client-key", _secret), "--curve-server-key"),
                          (("--curve-server-key", public, "--curve-client-key", public), "--curve-client-key"),
                          (("--curve-server-key", public), "--curve-client-key")):
        run = doctor(address, target, spec, *flags)
        assert run.returncode == 2 and "Traceback" not in run.stdout + run.stderr, run.stdout + run.stderr
        assert needle in run.stdout, run.stdout


def test_a_bad_target_description_exits_2(ngram, tmp_path):
    run = doctor(ngram.address, tmp_path, {"method": "ngram", "num_speculative_tokens": 4})
    assert run.returncode == 2 and "config.json not found" in run.stdout
    run = doctor(ngram.address, tmp_path, {"method": "ngram"})
    assert run.returncode == 2


def test_doctor_leaves_nothing_behind_on_the_server(ngram, checkpoints):
    from helpers.wire import Wire
    target, _ = checkpoints
    assert doctor(ngram.address, target, {"method": "ngram", "num_speculative_tokens": 4}).returncode == 0
    from helpers.steps import wait_until
    from k3_accel.protocol import Stats
    wire = Wire(ngram.address)
    try:
        def gone() -> bool:          # its goodbye is on the wire when doctor exits; let it land
            stats = wire.call(Stats()).result
            return not [n for n in stats["sessions"] if n.startswith("k3-accel-doctor")]
        assert wait_until(gone, timeout=60)
        stats = wire.call(Stats()).result
        assert stats["active"] == 0 and stats["retained"] == 0
    finally:
        wire.close()


def test_doctor_reports_the_fair_share_this_target_would_get_now(ngram, checkpoints):
    target, _ = checkpoints
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    busy = Wire(ngram.address)
    try:
        blocks = busy.caps.pool_blocks
        assert wait_until(lambda: not any(s["active"] or s["retained"]       # earlier doctors are gone
                                          for s in busy.call(Stats()).result["sessions"].values()))
        run = doctor(ngram.address, target, spec)
        assert f"fair share now: {blocks} of {blocks} pool blocks" in run.stdout, run.stdout   # alone: all
        busy.ingest([(0, 0, [1, 2, 3])]).raise_for_error()                  # another target holds a context
        run = doctor(ngram.address, target, spec)
        assert run.returncode == 0 and f"fair share now: {blocks // 2} of {blocks} pool blocks" in run.stdout
        assert "2048 of 4096 requests guaranteed (weight 1)" in run.stdout
    finally:
        busy.call(Bye())
        busy.close()


def test_doctor_reads_the_aux_layers_and_the_draft_tp_as_the_plugin_does(tmp_path, checkpoints):
    """Out-of-order and repeated layer ids become the ascending set the plugin ships; a draft whose
    heads do not divide the target's TP gets a note (the plugin sets draft TP 1), not a failure."""
    from k3_accel.doctor import draft_tp_note, target_needs

    target, draft = checkpoints
    cfg = json.loads((draft / "config.json").read_text())
    cfg["dflash_config"]["target_layer_ids"] = [2, 0, 2]
    cfg["num_attention_heads"] = 6
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = {"method": "dflash", "model": str(tmp_path), "num_speculative_tokens": 4}
    needs, spec_ns = target_needs(str(target), spec, 8)
    assert needs.aux_layer_ids == (0, 2) and needs.context_width == 2 * needs.hidden_size
    assert "not divisible by TP 4" in draft_tp_note(spec_ns, 4)
    assert draft_tp_note(spec_ns, 2) is None and draft_tp_note(spec_ns, 1) is None
    _, explicit = target_needs(str(target), {**spec, "draft_tensor_parallel_size": 1}, 8)
    assert draft_tp_note(explicit, 4) is None


def test_a_draft_tp_vllm_refuses_is_a_failure(tmp_path, checkpoints):
    """vLLM 0.33 takes draft_tensor_parallel_size 1 or the target's TP only, and refuses a draft whose
    heads do not divide its draft TP (verify_with_parallel_config): written out, no hook changes it."""
    from helpers.ports import free_port
    target, draft = checkpoints
    cfg = json.loads((draft / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 6}))
    spec = {"method": "dflash", "model": str(tmp_path), "num_speculative_tokens": 4}
    address = f"tcp://127.0.0.1:{free_port()}"
    run = doctor(address, target, {**spec, "draft_tensor_parallel_size": 2}, "--tensor-parallel-size", "4")
    assert run.returncode == 1 and "draft_tensor_parallel_size 2" in run.stdout, run.stdout
    assert "is not 1 or the target's TP 4" in run.stdout
    run = doctor(address, target, {**spec, "draft_tensor_parallel_size": 4}, "--tensor-parallel-size", "4")
    assert run.returncode == 1, run.stdout
    assert "6 attention heads, not divisible by draft_tensor_parallel_size 4" in run.stdout


@pytest.mark.parametrize("vllm_here", [True, False])
def test_doctor_resolves_aux_layers_as_vllm_with_or_without_vllm(monkeypatch, tmp_path, checkpoints, vllm_here):
    """A draft host needs no vLLM, and the doctor then reads the aux layers in vLLM's order itself:
    eagle_aux_hidden_state_layer_ids (capture indices: id + 1) before dflash_config.target_layer_ids,
    and a DSpark draft's dspark_target_layer_ids."""
    import sys
    from k3_accel.doctor import target_needs
    if not vllm_here:
        monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils", None)
    target, draft = checkpoints
    cfg = json.loads((draft / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eagle_aux_hidden_state_layer_ids": [4, 2]}))
    spec = {"method": "dflash", "model": str(tmp_path), "num_speculative_tokens": 4}
    assert target_needs(str(target), spec, 8)[0].aux_layer_ids == (1, 3)
    dflash = {key: value for key, value in cfg["dflash_config"].items() if key != "target_layer_ids"}
    dspark = {**cfg, "architectures": ["Qwen3DSparkModel"], "dflash_config": dflash,
              "dspark_target_layer_ids": [2, 0]}
    (tmp_path / "config.json").write_text(json.dumps(dspark))
    spec = {"method": "dspark", "model": str(tmp_path), "num_speculative_tokens": 4}
    assert target_needs(str(target), spec, 8)[0].aux_layer_ids == (0, 2)


@pytest.fixture(scope="module")
def dflash_out_of_order(tmp_path_factory, checkpoints):
    """A real DFlash server whose draft config lists its target layers out of order ([2, 0])."""
    target, _ = checkpoints
    draft = write_tiny_dflash(tmp_path_factory.mktemp("doctor-dflash") / "draft", target, target_layer_ids=[2, 0])
    srv = ServerProcess("--engine", "dflash", "--draft-model", str(draft), "--target-model", str(target),
                        "--num-speculative-tokens", "4", "--lease-s", "600")
    yield draft, srv
    assert srv.stop() == 0


def test_doctor_against_a_dflash_server_whose_draft_lists_its_layers_out_of_order(dflash_out_of_order, checkpoints):
    """vLLM captures the layers ascending, the server advertises them ascending, and the doctor
    compares them the same way: an out-of-order draft config is not refused; a target whose draft
    captures other layers is, naming both lists."""
    target, _ = checkpoints
    draft, srv = dflash_out_of_order
    w = Wire(srv.address)
    assert w.caps.aux_layer_ids == [0, 2] and w.caps.engine == "dflash"
    w.call(Bye())
    w.close()
    run = doctor(srv.address, target, {"method": "dflash", "model": str(draft), "num_speculative_tokens": 4},
                 "--max-num-seqs", "8")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "aux layers [0, 2] x hidden" in run.stdout and "FAIL" not in run.stdout
    other = write_tiny_dflash(draft.parent / "other", target, target_layer_ids=[1, 0])
    run = doctor(srv.address, target, {"method": "dflash", "model": str(other), "num_speculative_tokens": 4})
    assert run.returncode == 1, run.stdout + run.stderr
    assert "aux layer ids: server [0, 2], target captures [0, 1]" in run.stdout


@pytest.mark.parametrize("argv", [
    ["probe", "tcp://127.0.0.1:9", "--timeout-ms", "-1"],
    ["probe", "tcp://127.0.0.1:9", "--timeout-ms", "0"],
    ["doctor", "tcp://127.0.0.1:9", "--model", "m", "--speculative-config", "{}", "--timeout-ms", "-5"],
    ["doctor", "tcp://127.0.0.1:9", "--model", "m", "--speculative-config", "{}", "--max-num-seqs", "0"],
    ["doctor", "tcp://127.0.0.1:9", "--model", "m", "--speculative-config", "{}", "-tp", "0"],
    ["doctor", "tcp://127.0.0.1:9", "--model", "m", "--speculative-config", "{}", "--max-num-batched-tokens", "-1"],
])
def test_numbers_out_of_range_are_usage_errors_naming_the_flag(argv, capsys):
    """A timeout, a batch or TP size below 1 is a usage error (exit 2) naming the flag: a negative
    probe timeout was a ZMQ poll(-1) that never returned, a zero TP a division later on."""
    from k3_accel.cli import build_parser
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    assert stop.value.code == 2
    flag = next(a for a in argv if a.startswith("-") and not a.lstrip("-").isdigit() and a != argv[-1])
    assert flag in capsys.readouterr().err
