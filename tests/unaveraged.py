"""A control for ``tests/test_frameworks.py``: a DDP wrapper that never averages, so every rank steps on
its own gradients. A comparison with torch's DDP that this wrapper passes could not tell right from wrong."""
import ddpkit


class Unaveraged(ddpkit.NaiveDDP):
    def finish_gradient_synchronization(self) -> None:
        pass  # the end of backward calls this: nothing is reduced
