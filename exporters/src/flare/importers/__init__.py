"""Other tools' traces into the Flare store, as ordinary Flare spans: `kineto`
(PyTorch profiler traces)."""
