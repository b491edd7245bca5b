"""The device-free side: requests, the scheduler, the paged KV-cache bookkeeping and the step messages (no torch)."""
