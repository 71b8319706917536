"""Sampled drafts on the wire: a propose's optional temperature and seed per request.

Old and new peers interoperate: a greedy propose leaves the ``sampling`` field off the wire
(a server that predates it decodes it), a client sends temperatures only to a server whose
hello offers ``sampling`` (an n-gram server drafts greedily and is never sent one), and a
server whose engine cannot sample refuses a sampled propose with a typed error."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest

from helpers.oracles import ngram_lookup as lookup
from helpers.steps import step as rows
from helpers.wire import ints, meta
from k3_accel import protocol as p
from k3_accel.protocol import ErrorCode, ProtocolError
from k3_accel.server import rows as server_rows
from k3_accel.server.engines.base import EngineCaps

SPANS = dict(handles=[3, 4], starts=[0, 0], counts=[2, 1], anchors=[9, 8])


def _frames(temperature=None, seeds=None, sampling=None):
    frames = [meta(SPANS["handles"], SPANS["starts"], SPANS["counts"], SPANS["anchors"]), ints([1, 2, 3])]
    if temperature is not None:
        frames += [np.asarray(temperature, dtype=np.float32).data, ints(seeds)]
    flag = temperature is not None if sampling is None else sampling
    return p.encode_request(7, p.Propose(4, 2, 3, sampling=flag), *frames)


def test_sampled_propose_round_trip():
    req = p.decode_request(_frames([0.0, 1.5], [-(2**40), 2**62 + 5]))
    assert req.msg.sampling
    assert req.temperature.tolist() == [0.0, 1.5] and req.seeds.tolist() == [-(2**40), 2**62 + 5]


def test_a_greedy_propose_leaves_the_field_off_for_old_servers():
    header = msgpack.unpackb(bytes(_frames()[0]))
    assert len(header[2]) < 1 + len(p.Propose.__struct_fields__)        # no trailing sampling=False
    req = p.decode_request(_frames())
    assert not req.msg.sampling and req.temperature is None and req.seeds is None


@pytest.mark.parametrize("temperature", [[float("nan"), 1.0], [-0.5, 1.0], [float("inf"), 0.0]])
def test_temperatures_must_be_finite_and_not_negative(temperature):
    with pytest.raises(ProtocolError) as err:
        p.decode_request(_frames(temperature, [1, 2]))
    assert err.value.code is ErrorCode.BAD_FIELD and err.value.seq == 7 and "temperature" in err.value.message


def test_sampling_frames_are_counted_and_sized():
    with pytest.raises(ProtocolError) as err:                 # flag without the frames
        p.decode_request(_frames(sampling=True))
    assert err.value.code is ErrorCode.FRAME_MISMATCH
    frames = _frames([0.5, 0.5], [1, 2])
    frames[-1] = ints([1, 2, 3])                              # three seeds for two requests
    with pytest.raises(ProtocolError) as err:
        p.decode_request(frames)
    assert err.value.code is ErrorCode.FRAME_MISMATCH and "seeds" in err.value.message


def test_an_engine_that_cannot_sample_refuses_a_sampled_propose():
    req = p.decode_request(_frames([0.5, 0.0], [1, 2]))
    greedy = EngineCaps(kind="ngram", needs_hidden_states=False, context_width=0, max_spec_tokens=8)
    with pytest.raises(ProtocolError) as err:
        server_rows.check_message(req, greedy)
    assert err.value.code is ErrorCode.UNSUPPORTED
    sampling = EngineCaps(kind="dspark", needs_hidden_states=False, context_width=0, max_spec_tokens=8,
                          sampling=True)
    checked = server_rows.check_message(req, sampling)
    assert checked.temperature.tolist() == [0.5, 0.0] and checked.seeds.tolist() == [1, 2]


def test_a_client_sends_no_temperatures_to_a_server_without_sampling(server, client_factory):
    client = client_factory(server.address)
    history, anchor = [5, 6, 7, 8, 5, 6], 7
    step = rows(["a"], [(0, history)], anchors=[anchor])
    step.temperature, step.seeds = [0.9], [12345]
    out = client.step(step)
    assert not client.link.caps.sampling                       # an n-gram server: hello says no sampling
    found = lookup([*history, anchor], 4)
    assert found and out.drafts.tolist() == [found + [-1] * (4 - len(found))]   # greedy, no error
    assert client.server_stats()["errors"] == {}
