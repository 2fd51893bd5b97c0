"""trainserve's pipeline: one module per stage, the typed config and the CLI at the top level.

train.py consolidate.py export.py run.py serve.py ui.py   the stages, each with one main()
verify.py trace.py                                         re-prove a registered model; trace a
                                                           request
cli.py config.py config_cli.py                             `pipeline <stage>` and the typed config
components/    what the stages are built from (checkpoints, data, tasks, tracking, gates, export,
               ...)
distributed/   process group, collectives, replica checks, DDP/FSDP2 wrapping
models/        built-in models, components like any user's
datasets/      built-in data sets, components like any user's
tools/         logging, SIGTERM handling, fault injection
"""
