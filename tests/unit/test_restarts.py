"""``dpserve serve``'s restart policy: the backoff schedule, the crash-loop bound, and how an
exit is described."""

from __future__ import annotations

import pytest

from dpserve import restarts
from dpserve.restarts import Deaths, RestartPolicy, describe_exit


def test_the_backoff_doubles_from_one_second_up_to_thirty() -> None:
    policy = RestartPolicy()
    assert [policy.backoff(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 30, 30, 30]
    assert policy.backoff(10_000) == 30  # no overflow however many deaths


def test_the_defaults_are_the_documented_ones() -> None:
    assert (restarts.FIRST_BACKOFF_S, restarts.MAX_BACKOFF_S) == (1.0, 30.0)
    assert (restarts.CRASH_LOOP_DEATHS, restarts.CRASH_LOOP_WINDOW_S) == (5, 300.0)


def test_the_fifth_death_within_the_window_leaves_the_child_down() -> None:
    deaths = Deaths()
    assert [deaths.record(t) for t in (0.0, 2.0, 5.0, 10.0)] == [1, 2, 4, 8]
    assert deaths.record(19.0) is None
    assert deaths.recent == 5


def test_deaths_older_than_the_window_are_forgotten() -> None:
    deaths = Deaths(RestartPolicy(crash_loop_deaths=3, crash_loop_window=60.0))
    assert deaths.record(0.0) == 1
    assert deaths.record(30.0) == 2
    # The first death is 60 s old: out of the window, so this is the second, not the third.
    assert deaths.record(60.0) == 2
    assert deaths.recent == 2
    assert deaths.record(61.0) is None  # 30, 60, 61: three within a minute


def test_a_child_that_dies_once_an_hour_is_restarted_for_ever() -> None:
    deaths = Deaths()
    assert all(deaths.record(hour * 3600.0) == 1 for hour in range(100))


@pytest.mark.parametrize(
    "returncode, words",
    [
        (0, "exited with code 0"),
        (1, "exited with code 1"),
        (-9, "was killed by SIGKILL"),
        (-15, "was killed by SIGTERM"),
        (-11, "was killed by SIGSEGV"),
        (-200, "was killed by signal 200"),
    ],
)
def test_an_exit_is_described_by_its_code_or_signal_name(returncode: int, words: str) -> None:
    assert describe_exit(returncode) == words


@pytest.mark.parametrize(
    "settings",
    [
        {"first_backoff": 0.0},
        {"first_backoff": 2.0, "max_backoff": 1.0},
        {"crash_loop_deaths": 0},
        {"crash_loop_window": 0.0},
    ],
)
def test_a_policy_that_makes_no_sense_is_refused(settings: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        RestartPolicy(**settings)


def test_deaths_count_from_one() -> None:
    with pytest.raises(ValueError):
        RestartPolicy().backoff(0)
