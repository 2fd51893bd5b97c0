"""trainserve's pipeline: config, data, models, distributed setup, checkpoints, tracking and the stages."""
