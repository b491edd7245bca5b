"""Samplers of the defective plugin."""

from patchbay_example.sampler import ArgmaxSampler


class UnavailableSampler(ArgmaxSampler):
    """Greedy argmax that claims to be unavailable everywhere, so each behavioural check would skip."""

    @classmethod
    def unavailable_reason(cls):
        return "needs the (imaginary) FooAccelerator"


class EagerSampler(ArgmaxSampler):
    """A correct greedy sampler; its defect is in how its plugin registers it."""
