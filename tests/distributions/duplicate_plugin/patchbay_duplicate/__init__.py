"""patchbay-duplicate-plugin: registers sampler ``example_argmax``, which patchbay-example-plugin also registers."""
