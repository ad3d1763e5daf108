"""foundation.gcpause: no cycle collection inside, the collector's state restored after (errors, nesting)."""

from __future__ import annotations

import gc

import pytest

from gpuguard.foundation.gcpause import gc_paused


def test_the_collector_waits_inside_and_runs_again_after():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner one does not re-enable what the outer paused
    assert gc.isenabled()


def test_an_error_inside_still_restores_it_and_a_disabled_collector_stays_disabled():
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("decision failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
