"""rung.runtime.worker: model runner, input batch, attention groups, samplers."""
