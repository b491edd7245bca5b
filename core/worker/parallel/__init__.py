"""One rank's side of tensor and pipeline parallelism: its process, process group, shards, stages and channels."""
