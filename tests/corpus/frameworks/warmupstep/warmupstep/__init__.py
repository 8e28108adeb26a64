"""warmupstep: learning-rate warmup driven by a step counter that lives on the device."""
