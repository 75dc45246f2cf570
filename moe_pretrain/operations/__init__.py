"""The job around the training steps: the run loop (run_loop.run_training), the run directory's lock, the hang
watchdog, stop signals and preemption, the run's outcome and status records, the metrics writer and W&B, and the
straggler check's reports and files. It imports training/; nothing in training/ imports it.

Modules here are imported one by one: launch/train.py reads how an earlier worker group ended (outcome.py)
before torch is imported."""
