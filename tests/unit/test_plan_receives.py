"""The planner's 1F1B receive count in closed form equals the count on the runtime's own action lists
(plan/buffers.py `one_f_one_b_receives` against `receives_alive_on_lists`), for every depth and
micro-batch count tried."""
from fivefold.plan.buffers import one_f_one_b_receives, receives_alive_on_lists
from fivefold.rules import ONE_F_ONE_B


def test_one_f_one_b_receives_closed_form_equals_the_lists():
    for pp in range(2, 17):
        for m in sorted({1, 2, 3, pp - 1, pp, pp + 1, 2 * pp, 3 * pp} - {0}):
            assert one_f_one_b_receives(pp, m) == receives_alive_on_lists(ONE_F_ONE_B, pp, m, 1), (pp, m)
