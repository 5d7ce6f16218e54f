"""rung.runtime.worker: model runner, input batch, attention groups, samplers, the step's
one host copy."""
