"""The service tunes the process's cyclic GC while it serves and gives the process its own settings back after:
a trainer that runs the service in its own process keeps its GC as it was."""

from __future__ import annotations

import gc
from contextlib import ExitStack

import pytest
from pydantic import ValidationError

from nemo_gym_prorl.launch.runtime import ServiceSettings
from nemo_gym_prorl.service.gc_tuning import GcSettings, tuned_gc


def test_settings_apply_while_serving_and_the_process_gets_its_own_back() -> None:
    before = gc.get_threshold()
    with tuned_gc(GcSettings(thresholds=(40_000, 15, 90))):
        assert gc.get_threshold() == (40_000, 15, 90)
        assert gc.get_freeze_count() > 0  # what was alive at start is out of every collection
        assert gc.isenabled()  # cycles are still collected
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0


def test_services_running_at_once_keep_the_collector_tuned_until_the_last_stops() -> None:
    before = gc.get_threshold()
    first, second = ExitStack(), ExitStack()  # two services' lifetimes, overlapping without nesting
    first.enter_context(tuned_gc(GcSettings(thresholds=(40_000, 15, 90))))
    second.enter_context(tuned_gc(GcSettings(thresholds=(40_000, 15, 90))))
    first.close()  # the first service stops while the second still serves
    assert (gc.get_threshold(), gc.get_freeze_count() > 0) == ((40_000, 15, 90), True)
    second.close()
    assert (gc.get_threshold(), gc.get_freeze_count()) == (before, 0)


def test_null_thresholds_and_no_freeze_leave_the_collector_alone() -> None:
    before = gc.get_threshold()
    with tuned_gc(GcSettings(freeze_at_start=False, thresholds=None)):
        assert (gc.get_threshold(), gc.get_freeze_count()) == (before, 0)


def test_a_threshold_that_would_turn_collection_off_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match=r"gc\.thresholds\.0"):
        ServiceSettings.model_validate({"gc": {"thresholds": [0, 10, 10]}})
