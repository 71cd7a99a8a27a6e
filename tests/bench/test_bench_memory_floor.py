"""The memory floor of ``bench/train_step`` and the itemization of its RssAnon
trace, in exact bytes."""

from bench.train_step.memory_report import floor_bytes
from bench.train_step.memtrace import itemize

N = 124_668_672  # the ~125M llama of bench/train_step


def test_floor_is_16_bytes_per_parameter_over_tp_plus_bare():
    assert floor_bytes(N, tp=1, bare=0) == 16 * N
    assert floor_bytes(N, tp=2, bare=310 * 2**20) == 8 * N + 310 * 2**20
    assert floor_bytes(N, tp=2, dp=4, bare=0) == 8 * N  # without ZeRO-1, dp does not change it


def test_zero1_floor_divides_only_adamw_by_dp():
    assert floor_bytes(N, tp=1, dp=2, zero1=True, bare=0) == (4 + 4 + 4) * N
    assert floor_bytes(N, tp=2, dp=4, zero1=True, bare=7) == (4 + 4 + 2) * N / 2 + 7


def _phase(step, phase, start, peak):
    return dict(step=step, phase=phase, start=start, peak=peak, seconds=0.0)


def test_itemize_subtracts_the_start_of_each_step():
    phases = [_phase(-1, "setup", 50, 60), _phase(0, "forward", 100, 180), _phase(0, "backward", 170, 250),
              _phase(0, "optimizer", 200, 230), _phase(1, "forward", 210, 300), _phase(1, "backward", 290, 280),
              _phase(1, "end", 205, 205)]
    first, last = itemize(phases)
    assert first == dict(step=0, begin=100, phases=dict(forward=80, backward=150, optimizer=130), end=210, peak=250)
    assert last == dict(step=1, begin=210, phases=dict(forward=90, backward=70), end=205, peak=300)
