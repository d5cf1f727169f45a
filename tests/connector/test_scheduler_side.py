"""The connector's scheduler side (connector/scheduler.py) and its settings, on the records vLLM
hands it: which requests are captured, where their files go (no client chooses), the step record
the workers get, what a finished, aborted or preempted request becomes."""

from __future__ import annotations

from types import SimpleNamespace as NS

import pytest

from speculators_compat.connector.records import ConnectorSettings
from speculators_compat.connector.scheduler import SchedulerSide, wants_capture


def params(max_tokens=1, kv=None):
    return NS(max_tokens=max_tokens, extra_args={"kv_transfer_params": kv} if kv is not None else None)


@pytest.mark.parametrize(
    "sp,want",
    [
        (params(1), (True, False)),  # speculators' states call
        (params(512), (False, False)),  # a chat answer (regenerate-responses)
        (params(8, {"include_output_tokens": True}), (True, True)),
        (params(8, {"capture_hidden_states": True}), (True, False)),
        (params(1, {"capture_hidden_states": False}), (False, False)),
        (params(1, {"hidden_states_path": "/etc/x"}), (True, False)),
        (None, (False, False)),  # a pooling request
    ],
)
def test_which_requests_are_captured(sp, want):
    assert wants_capture(sp) == want


def new_req(rid, n, sp, computed=0):
    return NS(req_id=rid, prompt_token_ids=list(range(n)), sampling_params=sp, num_computed_tokens=computed)


def sched_out(new=(), resumed=()):
    return NS(scheduled_new_reqs=list(new), scheduled_cached_reqs=NS(resumed_req_ids=set(resumed)))


def test_the_step_record_and_the_finished_request(tmp_path):
    side = SchedulerSide(ConnectorSettings(str(tmp_path)), max_model_len=100)
    kv = {"include_output_tokens": True, "hidden_states_path": "/etc/passwd"}
    step = side.build(
        sched_out([new_req("a/../b", 5, params(1)), new_req("g", 10, params(512)), new_req("o", 7, params(50, kv))])
    )
    assert [c.req_id for c in step.new] == ["a/../b", "o"]
    a, o = step.new
    assert a.path == str(tmp_path / "a_.._b.safetensors")  # (a client's path and slashes: never used)
    assert (a.prompt_len, a.capture_len) == (5, 5)
    assert (o.prompt_len, o.capture_len) == (7, 56) and o.path.startswith(str(tmp_path))
    assert side.build(sched_out(resumed=["o", "g"])).restarted == ["o"]
    done = NS(request_id="o", status=NS(name="FINISHED_LENGTH_CAPPED"), all_token_ids=list(range(12)))
    assert side.finished(done) == (True, {"hidden_states_path": o.path})
    gone = NS(request_id="a/../b", status=NS(name="FINISHED_ABORTED"), prompt_token_ids=list(range(5)))
    assert side.finished(gone) == (False, None)
    assert side.finished(NS(request_id="g", status=None)) == (False, None)  # not captured
    step = side.build(sched_out())
    assert [(f.req_id, f.token_ids) for f in step.finished] == [("o", list(range(11)))]  # (last: never an input)
    assert [d.req_id for d in step.dropped] == ["a/../b"]
    assert not side.build(sched_out())


def test_a_request_past_its_start_is_not_captured(tmp_path):
    side = SchedulerSide(ConnectorSettings(str(tmp_path)), max_model_len=100)
    assert not side.build(sched_out([new_req("p", 9, params(1), computed=4)])).new


@pytest.mark.parametrize(
    "extra,message",
    [
        ({}, "needs shared_storage_path"),
        ({"shared_storage_path": "/x", "layers": [1]}, "unknown kv_connector_extra_config key(s) ['layers']"),
        ({"shared_storage_path": "/x", "layer_ids": [1, "2"]}, "layer_ids must be a list of integers"),
        ({"shared_storage_path": "/x", "states_dtype": "int4"}, "states_dtype must be one of"),
        ({"shared_storage_path": "/x", "self_check": "yes"}, "self_check must be true or false"),
    ],
)
def test_bad_settings_are_named(extra, message):
    with pytest.raises(ValueError) as e:
        ConnectorSettings.from_extra(extra)
    assert message in str(e.value)


def test_settings():
    s = ConnectorSettings.from_extra({"shared_storage_path": "/hs", "layer_ids": "2,14,26", "states_dtype": "fp8"})
    assert (s.path, s.layer_ids, s.states_dtype, s.self_check) == ("/hs", (2, 14, 26), "fp8", True)
