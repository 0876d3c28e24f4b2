"""The Serve app's metrics: the workers' running totals become Prometheus increments."""

from svip_serve.metrics import Totals


def test_a_total_counts_up_by_what_it_grew():
    totals = Totals()
    assert [totals.delta("shed", n) for n in (0, 2, 2, 5)] == [0, 2, 0, 3]


def test_a_total_that_went_down_is_a_replaced_workers_and_all_new():
    totals = Totals()
    assert [totals.delta("forks", n) for n in (4, 1, 3)] == [4, 1, 2]


def test_each_total_counts_on_its_own():
    totals = Totals()
    assert (totals.delta("a", 3), totals.delta("b", 1), totals.delta("a", 4)) == (3, 1, 1)
