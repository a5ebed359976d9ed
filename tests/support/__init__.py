"""Helpers the engine tests and benchmarks share: a TransferEngine in a child process (peer), two hosts
in network namespaces (netns), GPU Ray actors with an engine each (cuda_actors)."""
