"""spot-runner: make training on spot / preemptible GPUs safe."""

__version__ = "0.1.0"
