"""SPECULATORS_COMPAT_DRIVER_WAIT is checked before an engine starts (the behaviour itself is
tested on the real engine: tests/engine/test_dropin.py::test_driver_waits_for_replies_without_spinning)."""
import pytest

from speculators_compat.engine.driver_wait import DRIVER_WAIT_ENV, driver_wait_from_env, set_driver_wait


def test_default_is_vllms_own_wait(monkeypatch):
    monkeypatch.delenv(DRIVER_WAIT_ENV, raising=False)
    assert driver_wait_from_env() == "spin"
    monkeypatch.setenv(DRIVER_WAIT_ENV, "block")
    assert driver_wait_from_env() == "block"


@pytest.mark.parametrize("bad", ["", "Block", "sleep", "1"])
def test_bad_value_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv(DRIVER_WAIT_ENV, bad)
    with pytest.raises(ValueError, match=DRIVER_WAIT_ENV):
        driver_wait_from_env()


def test_unknown_executor_is_reported_not_silent(caplog):
    class NoQueues:  # an executor shape this module does not know (e.g. a future vLLM)
        pass

    with caplog.at_level("WARNING", logger="speculators_compat.engine"):
        assert set_driver_wait(NoQueues(), "block", {}) == []
    assert "no reply queue found on NoQueues" in caplog.text
    with pytest.raises(ValueError, match="driver wait"):
        set_driver_wait(NoQueues(), "nap", {})


@pytest.mark.parametrize("bad", ["yes", "async", "WAIT"])
def test_announce_setting_is_checked(monkeypatch, bad):
    """SPECULATORS_COMPAT_ANNOUNCE: unset means ahead; a bad value is refused, naming the variable,
    before any engine starts (the engine reads it first thing)."""
    from speculators_compat.engine.core import ANNOUNCE_ENV, announce_from_env

    monkeypatch.delenv(ANNOUNCE_ENV, raising=False)
    assert announce_from_env() == "ahead"
    monkeypatch.setenv(ANNOUNCE_ENV, "wait")
    assert announce_from_env() == "wait"
    monkeypatch.setenv(ANNOUNCE_ENV, bad)
    with pytest.raises(ValueError, match=f"{ANNOUNCE_ENV} must be one of wait, ahead, not '{bad}'"):
        announce_from_env()
