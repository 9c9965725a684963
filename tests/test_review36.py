"""review36: regressions found reviewing the strategy / cost-model-table refactor (CPU)."""
from kernels.cost_model import CostModel

AV = ("torch", "dma", "cuda", "staged")


def test_settled_table_refills_after_its_clear():
    """BlockCopier.copy()'s small-job hot path reads CostModel.settled_limits' table inline and
    calls kernel_limits only on a miss. The table is cleared at 4096 entries; a shape that
    kernel_limits had settled (in its own memo) before that clear must come back into the table
    at its next miss, as the copier's own memo did before the refactor: else it misses (two
    Python calls per job) for as long as kernel_limits' memo keeps it. Negative control: without
    the re-insert in kernel_limits' settled return, 96 of the 200 steady shapes miss for ever."""
    cm = CostModel()
    tab = cm.settled_limits(AV)

    def call(n):
        if ("h2d", 4096, n) in tab:
            return "hit"
        cm.kernel_limits("h2d", 4096, n, AV)
        return "miss"
    for n in range(1, 4001):          # 4000 shapes settled
        call(n), call(n)
    for n in range(20000, 20100):     # one-off shapes: kernel_limits' memo clears (> 4096)
        call(n)
    steady = range(10000, 10200)      # a steady set: settled, then the table clears at 4096
    for _ in range(3):
        for n in steady:
            call(n)
    for n in steady:
        call(n)                       # at most one miss each, then back in the table
    assert all(call(n) == "hit" for n in steady)
    for n in steady:                  # and the table's answers are kernel_limits' own
        assert tab[("h2d", 4096, n)] == cm.kernel_limits("h2d", 4096, n, AV)
