"""One unit convention for sizes: binary (KiB, MiB, GiB) in the CLI, the tables and the widget."""

from ddpkit.units import human_bytes


def test_sizes_take_the_largest_binary_unit_they_reach():
    assert human_bytes(512) == "512 B"
    assert human_bytes(1024) == "1.00 KiB"
    assert human_bytes(8_430_000) == "8.04 MiB"          # the MLP's gradients: 8.4 MB are 8.04 MiB
    assert human_bytes(3 * 2**30, 1) == "3.0 GiB"
    assert human_bytes(-2048) == "-2.00 KiB"              # a difference of sizes keeps its sign
