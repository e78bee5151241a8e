"""The Enwik8 ablation app, built on the library (which never imports it).

    fetch.py       read a compressed corpus, download, verify size and md5
    data.py        split any byte corpus 90/5/5 into the cache; batches; eval windows
    config.py      TrainConfig, presets, the LR schedule, the resume check
    cli.py         the command line derived from ModelConfig and TrainConfig
    trainer.py     Trainer: the loop, one optimizer step, resume, save
    state.py       TrainState: what a checkpoint holds (its state_dict is the checkpoint)
    step.py        a step's pieces: build_run, autocast, the optimizer, evaluate
    metrics.py     what a run reports: TensorBoard, the progress line, config.json
    checkpoint.py  atomic save / weights_only load of checkpoints, the run-dir guard
    files.py       the one atomic-write helper
    runtime.py     torchrun / DDP, CPU threads, signals, progress
    train.py       main(): python -m linear_rope.train, torchrun ... -m linear_rope.train
    sample.py      python -m linear_rope.sample
"""
